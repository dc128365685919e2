#!/usr/bin/env bash
# What the twelve scripts/train_<N>x<GPU>_<phase>.sh share: set up .venv when the project is not installed in it,
# then hand over to scripts/launch.py (the table, plan, preflight, data, tokenizer, torchrun, success check).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import importlib.metadata as m; m.version('nanochat')" 2>/dev/null; then
    if [ "${DRY_RUN:-0}" != 0 ]; then
        echo "DRY_RUN needs the environment to compute the plan: run 'bash dev/setup_env.sh' first" >&2
        exit 1
    fi
    bash dev/setup_env.sh
fi
export PATH="$PWD/.venv/bin:$PATH"  # the project's python and torchrun
exec python -m scripts.launch "$@"
