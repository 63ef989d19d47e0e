#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: redis-server (apt, when root), a venv, the project with extras.
# Usage: EXTRAS=gemma bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing redis-server with apt" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq redis-server >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq redis-server; }
  else
    echo "setup: redis-server is missing. Install it: 'sudo apt-get install -y redis-server' (Debian/Ubuntu)," >&2
    echo "       'brew install redis' (macOS), or run 'docker compose up -d redis' and pass --redis-url." >&2
    exit 1
  fi
fi

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: Python >= 3.11 is needed ($PY is $("$PY" --version 2>&1)); set PYTHON=python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# llama-cpp-python compiles llama.cpp on first install (about 6 min on 2 cores); pip caches the wheel.
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
.venv/bin/python -m pip install -q -e ".[dev${EXTRAS:+,$EXTRAS}]"
