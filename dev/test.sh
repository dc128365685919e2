#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite; extra arguments go to pytest (e.g. -m slow, -k causality).
# Three pytest workers (pytest-xdist), one file each at a time: module fixtures (a corpus, a tokenizer) are built once
# per file; three keep both cores of the CI machine busy while a test waits on a child process or a timeout
# (dev/LOG.md); the longest files first (tests/conftest.py). TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup_env.sh dev
# byte-compiled once here: with PYTHONDONTWRITEBYTECODE set (as on CI's machine) every child process a test starts
# would compile the package again, ~1 CPU s each (an import of scripts.base_train: 4.6 s against 3.5)
.venv/bin/python -m compileall -q -j 0 nanochat scripts dev tests > /dev/null
# --durations=20: the slowest tests in every log, so a machine slower than the one that timed the suite shows where
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder --durations=20 "$@"
