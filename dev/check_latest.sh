#!/usr/bin/env bash
# Drift check: install the newest versions pyproject.toml allows (ignoring requirements.lock) into a scratch venv and
# run the suite there, so a dependency's new release that breaks us is found here and not by a user.
# Usage: bash dev/check_latest.sh [pytest args]   (needs the package index; ~15 minutes on 2 cores)
# It passes: the ranges hold; `bash dev/lock.sh` moves the lock up to them. It fails: pin the culprit in
# pyproject.toml (its name is in the versions printed against the lock) or fix the code, then refresh the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
extras=$("$python" -c "import tomllib; print(','.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']))")
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade "pip>=24"
"$venv/bin/python" -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[$extras]"
echo "check_latest: versions that differ from requirements.lock"
"$venv/bin/python" -m pip freeze --exclude-editable | sort > "$venv/../installed.txt"
grep -E '^[A-Za-z0-9_.-]+==' requirements.lock | sort | comm -13 - "$venv/../installed.txt" || true
"$venv/bin/python" -m pytest -q "$@"
