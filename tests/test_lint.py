"""ruff, with the project's settings (pyproject.toml: pycodestyle, pyflakes and import order at 120 columns), finds
nothing in the repository; and it does find a line too long and an unused import in a file made to have them."""

import os
import shutil
import subprocess
import sys

from tests.support.helpers import ROOT

RUFF = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")


def ruff(*args):
    assert RUFF, "ruff is not installed: bash dev/setup_env.sh dev installs it from requirements.lock"
    return subprocess.run([RUFF, "check", "--no-cache", "--output-format=concise", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_repository_passes_ruff():
    result = ruff(".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_finds_a_long_line_and_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nx = '" + "a" * 130 + "'\n")
    result = ruff("--config", os.path.join(ROOT, "pyproject.toml"), str(bad))
    assert result.returncode == 1
    assert "E501" in result.stdout and "F401" in result.stdout
