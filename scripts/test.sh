#!/usr/bin/env bash
# The README's test command: set up (venv, deps, redis-server), then the whole suite.
# The suite starts its own redis-server on a free loopback port; no service needs to be running.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
