#!/usr/bin/env bash
# Refresh requirements.lock to the newest versions pyproject.toml allows, run the suite on them in a fresh .venv,
# and commit the lock if it passes. Usage: bash dev/lock.sh   (needs the package index; about 15 minutes on 2 cores)
# Why pip-tools and not uv.lock: uv ignores pip's local wheel directory, so on a CPU machine it would download the
# multi-GB CUDA torch; a pip constraints file installs torch==2.13.0 from whichever build the machine has.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
"$python" -m venv "$tools/venv"
"$tools/venv/bin/python" -m pip install --quiet "pip-tools>=7.4"
"$tools/venv/bin/pip-compile" --quiet --upgrade --all-extras --strip-extras --no-emit-index-url \
    --no-emit-find-links --output-file=requirements.lock.new pyproject.toml
# One version for every node: drop the local build tag (+cpu) so a GPU node resolves the same release to CUDA.
sed -E -i 's/^(torch==[0-9.]+)\+[a-z0-9]+$/\1/; s/(--output-file=)requirements\.lock\.new/\1requirements.lock/' \
    requirements.lock.new
mv requirements.lock.new requirements.lock
rm -rf .venv
bash dev/test.sh
if git diff --quiet -- requirements.lock; then
    echo "lock: unchanged"
else
    git add requirements.lock
    git commit -m "requirements.lock refreshed by dev/lock.sh; the suite passed on it" -- requirements.lock
fi
