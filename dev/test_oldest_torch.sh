#!/usr/bin/env bash
# The suite on the oldest torch pyproject.toml allows (2.11), in its own venv (.venv-oldest), every other package at
# requirements.lock's version: what a cloud image with an older torch runs. Not in CI (a multi-GB CUDA build of torch
# comes from PyPI). Extra arguments go to pytest, e.g. tests/test_optim.py tests/test_gpt.py.
#   bash dev/test_oldest_torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
oldest=$(sed -nE 's/^ *"torch>=([0-9.]+),.*/\1/p' pyproject.toml)
[ -n "$oldest" ] || { echo "test_oldest_torch: no \"torch>=X,...\" line in pyproject.toml" >&2; exit 2; }
venv=.venv-oldest
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
sed -E "s/^torch==.*/torch==$oldest.0/" requirements.lock > "$constraints"
"$venv/bin/python" -m pip install --quiet -c "$constraints" -e ".[dev]"
"$venv/bin/python" -c "import torch; print('test_oldest_torch: torch', torch.__version__)"
# the one test that must fail here: it checks that the running torch is the lock's
exec "$venv/bin/python" -m pytest -q \
    --deselect tests/test_environment.py::test_the_running_environment_holds_the_locked_versions "$@"
