#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite; extra arguments go to pytest (e.g. -m slow, -k causality).
# Two pytest workers (pytest-xdist), one file each at a time: module fixtures (a corpus, a tokenizer) are built once
# per file, and the suite takes both cores of the CI machine. TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup_env.sh dev
# --durations=20: the slowest tests in every log, so a machine slower than the one that timed the suite shows where
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --durations=20 "$@"
