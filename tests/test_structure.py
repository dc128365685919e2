"""The repository's layout rules: the modules under scripts/ are entry points, and what two of them share lives in
nanochat/, so no script imports another."""

import ast
import glob
import os

from tests.support.helpers import ROOT


def script_files():
    return sorted(glob.glob(os.path.join(ROOT, "scripts", "**", "*.py"), recursive=True))


def in_scripts(module):
    return module == "scripts" or module.startswith("scripts.")


def scripts_imported(source):
    """The scripts/ modules that source imports, inside functions too: import scripts.x, from scripts import x,
    from scripts.x import y, and relative imports (in a file under scripts/, `from .x import y` is scripts.x)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if in_scripts(alias.name)}
        elif isinstance(node, ast.ImportFrom):
            module = ".".join(filter(None, ["scripts" if node.level else None, node.module]))
            if in_scripts(module):
                found |= {f"scripts.{alias.name}" for alias in node.names} if module == "scripts" else {module}
    return found


def test_the_check_finds_every_form_of_import_even_inside_functions():
    source = """
import os, scripts.a
import scripts.b as b
from scripts import c, d as e
from scripts.f import g
def later():
    from scripts.h import i
    import scripts
class Lazy:
    def method(self):
        from . import j
        from .k import m
import scriptsx
from scriptsy import n
from nanochat import scripts
"""
    assert scripts_imported(source) == {"scripts.a", "scripts.b", "scripts.c", "scripts.d", "scripts.f", "scripts.h",
                                        "scripts", "scripts.j", "scripts.k"}


def test_every_script_is_checked():
    names = {os.path.relpath(path, ROOT) for path in script_files()}
    assert {"scripts/base_train.py", "scripts/launch.py", "scripts/compare.py", "scripts/serve.py"} <= names


def test_no_script_imports_another_script():
    offenders = {}
    for path in script_files():
        with open(path, encoding="utf-8") as f:
            imported = scripts_imported(f.read())
        if imported:
            offenders[os.path.relpath(path, ROOT)] = sorted(imported)
    assert not offenders, f"scripts importing scripts (move what they share into nanochat/): {offenders}"


# The library's rooms, by floor: a module may import its own room and the rooms on floors below, never one beside or
# above it. The model imports only itself (it is what the transformers export copies); the plumbing only itself; the
# trainer (the run that base_train and chat_sft share) sits on top.
FLOORS = {"model": 0, "plumbing": 0, "data": 1, "train": 2, "serve": 2, "checkpoint": 3, "eval": 3, "trainer": 4}
PLUMBING = {"common", "collectives", "files", "cli", "cuda_allocator"}
ENTRY_ALIASES = {"nanochat/dataset.py"}  # `python -m nanochat.dataset`, the documented command: an entry, not a room


def room_of(module):
    """The room of a dotted nanochat module name, or None outside the library."""
    parts = module.split(".")
    if parts[0] != "nanochat" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FLOORS else "plumbing" if parts[1] in PLUMBING else parts[1]


def nanochat_imported(source, package):
    """The nanochat modules that source imports (inside functions too); relative imports resolved against package.
    `from nanochat.train import optim` imports the module nanochat.train.optim; `from nanochat.files import x`,
    nanochat.files."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("nanochat.")}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module == "nanochat" or (module.count(".") == 1 and module.split(".")[1] in FLOORS):
                found |= {f"{module}.{alias.name}" for alias in node.names}
            elif module.startswith("nanochat."):
                found.add(module)
    return found


def library_files():
    return sorted(glob.glob(os.path.join(ROOT, "nanochat", "**", "*.py"), recursive=True))


def upward_imports(sources):
    """(file, imported module) pairs of sources ({path under the root: text}) that break the floors."""
    offenders = []
    for rel, source in sources.items():
        if rel in ENTRY_ALIASES:
            continue
        package = ".".join(os.path.dirname(rel).split("/"))
        own = room_of(rel[:-len(".py")].replace("/", "."))
        for module in sorted(nanochat_imported(source, package)):
            room = room_of(module)
            if room is None or room == own:
                continue
            if own in ("model", "plumbing") or FLOORS[room] >= FLOORS[own]:
                offenders.append((rel, module))
    return offenders


def library_sources():
    sources = {}
    for path in library_files():
        with open(path, encoding="utf-8") as f:
            sources[os.path.relpath(path, ROOT).replace(os.sep, "/")] = f.read()
    return sources


def test_every_library_module_lives_in_a_room():
    loose = [os.path.relpath(p, ROOT) for p in library_files()
             if os.path.dirname(p) == os.path.join(ROOT, "nanochat")
             and os.path.basename(p)[:-3] not in PLUMBING | {"__init__", "trainer"}
             and os.path.relpath(p, ROOT) not in ENTRY_ALIASES]
    assert loose == []
    rooms = {os.path.basename(os.path.dirname(p)) for p in library_files()} - {"nanochat"}
    assert rooms == set(FLOORS) - {"plumbing", "trainer"}


def test_no_import_runs_back_up_and_the_model_imports_only_itself():
    assert upward_imports(library_sources()) == []


def test_the_floor_check_finds_an_import_that_runs_back_up():
    model = "from .gpt import GPT\nfrom nanochat.common import print0\n"
    assert nanochat_imported(model, "nanochat.model") == {"nanochat.model.gpt", "nanochat.common"}
    data = "from nanochat.train import optim\nimport nanochat.eval.metrics\nfrom nanochat.data.synthetic import x\n"
    assert nanochat_imported(data, "nanochat.data") == {"nanochat.train.optim", "nanochat.eval.metrics",
                                                        "nanochat.data.synthetic"}
    assert room_of("nanochat.common") == "plumbing" and room_of("nanochat.eval.metrics") == "eval"
    assert room_of("torch.nn") is None
    bad = {"nanochat/model/engine.py": "from nanochat.common import print0\nfrom .halting import Halting\n",
           "nanochat/data/dataset.py": "from nanochat.train import optim\nfrom nanochat.files import x\n",
           "nanochat/eval/metrics.py": "from nanochat.checkpoint.manager import load_model\n",
           "nanochat/checkpoint/resume.py": "from nanochat.eval import loss_eval\nfrom nanochat.train import optim\n",
           "nanochat/files.py": "from nanochat.data.tokenizer import get_tokenizer\n"}
    assert upward_imports(bad) == [("nanochat/model/engine.py", "nanochat.common"),
                                   ("nanochat/data/dataset.py", "nanochat.train.optim"),
                                   ("nanochat/eval/metrics.py", "nanochat.checkpoint.manager"),
                                   ("nanochat/checkpoint/resume.py", "nanochat.eval.loss_eval"),
                                   ("nanochat/files.py", "nanochat.data.tokenizer")]


# The model file reads in one sitting, as nanochat's does: samplers, compile scopes and accounting live where their
# callers are (train/depth.py, train/compile.py, train/flops.py). It held at 625 lines, and grew back to 742.
MODEL_FILE_LINES = 650


def test_the_model_file_stays_the_model_alone():
    with open(os.path.join(ROOT, "nanochat", "model", "gpt.py"), encoding="utf-8") as f:
        lines = len(f.read().splitlines())
    assert lines <= MODEL_FILE_LINES, f"nanochat/model/gpt.py has {lines} lines, at most {MODEL_FILE_LINES}"
