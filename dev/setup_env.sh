#!/usr/bin/env bash
# Create .venv if missing and install the project into it at the exact versions of requirements.lock (what the
# suite passed on); a no-op when pyproject.toml, the lock and the extras are unchanged.
# Usage: bash dev/setup_env.sh [EXTRAS]   e.g. dev,plot  (EXTRAS are pyproject optional-dependency groups)
# torch is locked as 2.13.0 without a build tag: the CPU wheel on a CPU machine, PyPI's CUDA build on a GPU node.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-plot}
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
stamp=".venv/.installed-$(cat pyproject.toml requirements.lock | sha1sum | cut -c1-12)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
    echo "setup: installing nanochat[$extras] into .venv from requirements.lock (first run takes a few minutes)"
    # uv installs the same lock in a fraction of pip's time (parallel downloads and unpacking); it reads neither
    # pip.conf nor PIP_* variables, so pip's own indexes and find-links are handed to it; pip if it fails. Nothing is
    # byte-compiled here: compiling all 19,000 files took ~2 CPU minutes, and Python compiles what it imports once
    if [ "${SETUP_PIP_ONLY:-0}" != 1 ] && .venv/bin/python -m pip install --quiet uv 2> /dev/null; then
        mapfile -t sources < <(.venv/bin/python dev/pip_sources.py)
        .venv/bin/python -m uv pip install --quiet --python .venv/bin/python \
            --index-strategy unsafe-best-match "${sources[@]}" -c requirements.lock -e ".[$extras]" \
            || pip_install=1
    else
        pip_install=1
    fi
    if [ "${pip_install:-0}" = 1 ]; then
        .venv/bin/python -m pip install --quiet --upgrade "pip>=24"
        .venv/bin/python -m pip install --quiet -c requirements.lock -e ".[$extras]"
    fi
    touch "$stamp"
fi
