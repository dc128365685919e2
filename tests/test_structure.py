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
