#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite; extra arguments go to pytest (e.g. -m slow, -k causality).
# Three pytest workers (pytest-xdist), one file each at a time: module fixtures (a corpus, a tokenizer) are built once
# per file; three keep both cores of the CI machine busy while a test waits on a child process or a timeout
# (dev/LOG.md); the longest files first (tests/conftest.py). TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup_env.sh dev
# bytecode written as modules are first imported, even where PYTHONDONTWRITEBYTECODE is set (as on CI's machine):
# otherwise every child process a test starts compiles torch and the package again (an import of scripts.base_train
# took 4.6 CPU s against 3.5 compiled), and compiling the whole venv ahead took ~2 CPU minutes for the few it uses
export PYTHONDONTWRITEBYTECODE=
# --durations=20: the slowest tests in every log, so a machine slower than the one that timed the suite shows where
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder --durations=20 "$@"
