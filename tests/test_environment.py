"""The locked environment: requirements.lock covers every dependency and extra of pyproject.toml, pins torch to the
one release every node installs, and the environment dev/setup_env.sh built (the one running these tests) holds the
lock's versions."""

import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.helpers import ROOT

# what a drift would break first: the model's runtime, the export, the server, the evaluation and the data path
KEY_PACKAGES = ["torch", "transformers", "lm-eval", "datasets", "fastapi", "openai", "tiktoken", "numpy", "pyarrow"]


def locked():
    """{canonical name: version} of requirements.lock's pins."""
    text = (Path(ROOT) / "requirements.lock").read_text()
    return {canonicalize_name(name): v for name, v in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, re.M)}


def declared():
    """Every requirement of pyproject.toml: the dependencies and every optional group."""
    project = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["project"]
    groups = [project["dependencies"], *project["optional-dependencies"].values()]
    return [Requirement(text) for group in groups for text in group]


def test_the_lock_pins_every_declared_dependency_within_its_range():
    pins = locked()
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is in pyproject.toml but not in requirements.lock: bash dev/lock.sh"
        assert requirement.specifier.contains(pins[name], prereleases=True), (requirement, pins[name])


def test_torch_is_locked_without_a_build_tag_so_gpu_nodes_get_the_same_release():
    assert re.fullmatch(r"\d+\.\d+\.\d+", locked()["torch"])


def test_the_running_environment_holds_the_locked_versions():
    pins = locked()
    for name in KEY_PACKAGES:
        installed = version(name).split("+")[0]  # torch's CPU wheel is 2.13.0+cpu
        assert installed == pins[canonicalize_name(name)], f"{name} {installed} installed, {pins[name]} locked"


def test_the_editable_install_is_a_path_entry_without_setuptools_warning_box(tmp_path):
    """What `bash dev/setup_env.sh` runs (pip install -e .) builds its editable wheel with setuptools' backend: the
    checkout's root as a .pth line, and no "Please be careful with folders in your working directory" box."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(Path(ROOT) / name, tmp_path)
    shutil.copytree(Path(ROOT) / "nanochat", tmp_path / "nanochat", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "wheel").mkdir()
    build = "import sys; from setuptools import build_meta; print(build_meta.build_editable(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", build, str(tmp_path / "wheel")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "careful" not in result.stdout + result.stderr and "BuildBackendWarning" not in result.stderr
    with zipfile.ZipFile(tmp_path / "wheel" / result.stdout.split()[-1]) as wheel:
        pth = [name for name in wheel.namelist() if name.endswith(".pth")]
        assert [wheel.read(name).decode().strip() for name in pth] == [str(tmp_path.resolve())]


def test_uv_is_handed_pips_own_sources():
    """dev/setup_env.sh installs with uv, which reads no pip.conf: pip's indexes and find-links (a local torch wheel)
    must reach it, each once, whatever the scope that set them."""
    from dev.pip_sources import sources
    listing = ("global.extra-index-url='file:///a/simple file:///b/simple'\nglobal.find-links='/opt/wheels'\n"
               ":env:.find-links='/opt/wheels'\nglobal.cert='/etc/ssl/x.crt'\nuser.index-url=\"https://mirror/simple\"\n")
    assert sources(listing) == ["--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
                                "--find-links", "/opt/wheels", "--index-url", "https://mirror/simple"]
    assert sources("") == []
