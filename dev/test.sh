#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite; extra arguments go to pytest (e.g. -m slow, -k causality).
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup_env.sh dev
exec .venv/bin/python -m pytest -q "$@"
