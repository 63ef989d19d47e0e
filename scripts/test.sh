#!/usr/bin/env bash
# The README's test command: set up (venv, deps, redis-server), then the whole suite.
# The suite starts its own redis-server on a free loopback port; no service needs to be running.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two pytest workers (pytest-xdist): each starts its own redis-server; the suite takes about 3 minutes on
# 2 cores instead of about 6 (measured: 176.9 s against 348.6 s, 1079 tests).
exec .venv/bin/python -m pytest -q -n 2 "$@"
