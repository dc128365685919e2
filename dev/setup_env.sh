#!/usr/bin/env bash
# Create .venv if missing and install the project into it; a no-op when pyproject.toml and extras are unchanged.
# Usage: bash dev/setup_env.sh [EXTRAS]   e.g. dev,plot  (EXTRAS are pyproject optional-dependency groups)
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-plot}
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
    echo "setup: installing nanochat[$extras] into .venv (first run takes a few minutes)"
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[$extras]"
    touch "$stamp"
fi
