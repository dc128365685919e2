"""The README and the pages under docs/: the README stays short, every relative link in them (and in dev/LOG.md, and
every README.md#... or docs/*.md#... named in the code) reaches an existing file and, for an #anchor into a markdown
file, an existing heading; and the guides' table in the README is HARDWARE of scripts/launch.py, row for row."""

import glob
import os
import re

from scripts import launch
from tests.support.helpers import ROOT

README = os.path.join(ROOT, "README.md")
MAX_README_LINES = 250


def markdown_files():
    return [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))), os.path.join(ROOT, "dev", "LOG.md")]


def prose(text):
    """The lines of a markdown text outside fenced code blocks, with inline code spans removed."""
    fenced = False
    for line in text.splitlines():
        if re.match(r"\s*(```|~~~)", line):
            fenced = not fenced
            continue
        if not fenced:
            yield re.sub(r"`[^`]*`", "", line)


def slug(heading):
    """GitHub's anchor for a heading: link syntax dropped, lower case, punctuation but - and _ removed, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path):
    """Every heading anchor of a markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    found, seen = set(), {}
    fenced = False
    with open(path) as f:
        for line in f.read().splitlines():
            if re.match(r"\s*(```|~~~)", line):
                fenced = not fenced
            match = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if match:
                base = slug(match.group(1))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
    return found


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def target_problem(source, target):
    """What is wrong with a relative link from the file source to target (path, #anchor or path#anchor), or None."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
        return None
    path, _, anchor = target.partition("#")
    resolved = os.path.normpath(os.path.join(os.path.dirname(source), path)) if path else source
    if not os.path.exists(resolved):
        return f"{target}: no file {os.path.relpath(resolved, os.path.dirname(source))}"
    if anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
        return f"{target}: no heading #{anchor} in {os.path.basename(resolved)}"
    return None


def broken_links(path):
    with open(path) as f:
        text = f.read()
    problems = []
    for line in prose(text):
        for target in LINK.findall(line):
            problem = target_problem(path, target)
            if problem:
                problems.append(f"{os.path.basename(path)}: {problem}")
    return problems


def test_readme_is_at_most_250_lines():
    with open(README) as f:
        lines = f.read().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to a docs/ page"


def test_every_relative_link_reaches_a_file_and_heading():
    assert len(markdown_files()) >= 3  # the README, docs/ pages, the log
    problems = [p for path in markdown_files() for p in broken_links(path)]
    assert problems == []


def test_every_docs_page_is_linked_from_the_readme():
    with open(README) as f:
        linked = {os.path.normpath(t.partition("#")[0]) for line in prose(f.read()) for t in LINK.findall(line)}
    pages = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))}
    assert pages - linked == set()


def test_anchors_named_in_the_code_exist():
    """Help texts, messages and comments that point at README.md#... or docs/NAME.md#... point at a real heading."""
    code = [p for d in ("nanochat", "scripts", "dev") for ext in ("py", "sh")
            for p in glob.glob(os.path.join(ROOT, d, "**", f"*.{ext}"), recursive=True)]
    problems = []
    for path in code:
        with open(path) as f:
            for target in re.findall(r"((?:README|docs/[\w-]+)\.md#[\w-]+)", f.read()):
                problem = target_problem(os.path.join(ROOT, "README.md"), target)
                if problem:
                    problems.append(f"{os.path.relpath(path, ROOT)}: {problem}")
    assert problems == []


def test_the_link_check_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Plan first: `--dry_run`\n\n## Twice\n\n## Twice\n")
    (tmp_path / "README.md").write_text(
        "# Title\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#plan-first---dry_run) [ok](docs/page.md#twice-1) [ok](#title)\n"
        "[web](https://example.com/nowhere.md#x) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n# not a heading\n```\n"
        "[gone](docs/missing.md) [bad anchor](docs/page.md#plan-last) [bad](#not-a-heading) "
        "[dup](docs/page.md#twice-2)\n"
        "![image](docs/missing.png)\n")
    problems = broken_links(str(tmp_path / "README.md"))
    assert [p.split(": ")[1] for p in problems] == [
        "docs/missing.md", "docs/page.md#plan-last", "#not-a-heading", "docs/page.md#twice-2", "docs/missing.png"]


def test_slug_is_githubs():
    assert slug("The recursion: bounded states (`--grid=recursion`)") == "the-recursion-bounded-states---gridrecursion"
    assert slug("What holding a halted token's keys costs, and a head trained afterwards (2026-11-24)") == \
        "what-holding-a-halted-tokens-keys-costs-and-a-head-trained-afterwards-2026-11-24"
    assert slug("Byte-level vocabulary and base_eval on the CPU pipeline (2026-11-23)") == \
        "byte-level-vocabulary-and-base_eval-on-the-cpu-pipeline-2026-11-23"


# ------------------------------------------------------------------------------------- the guides' table in the README
def readme_hardware_table(text):
    """{node: cells} of the README's table whose header starts with | node |."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*node\s*\|", line))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = dict(zip(header, (c.strip() for c in line.strip().strip("|").split("|"))))
        rows[cells["node"]] = cells
    return rows


def phase_cell(cell):
    match = re.fullmatch(r"(\d+) x (\d+), ([\d.]+)-([\d.]+) s", cell)
    assert match, f"unreadable phase cell {cell!r}"
    return int(match[1]), int(match[2]), (float(match[3]), float(match[4]))


def table_problems(rows, hardware):
    problems = [f"{key}: in HARDWARE, not in the README" for key in hardware if key not in rows]
    problems += [f"{key}: in the README, not in HARDWARE" for key in rows if key not in hardware]
    for key in rows.keys() & hardware.keys():
        cells, hw = rows[key], hardware[key]
        if cells["GPU memory"] != f"{hw['gb']} GB":
            problems.append(f"{key}: GPU memory {cells['GPU memory']}, HARDWARE {hw['gb']} GB")
        if float(cells["$/hour"]) != hw["price"]:
            problems.append(f"{key}: $/hour {cells['$/hour']}, HARDWARE {hw['price']}")
        for phase, column in (("fast", "Phase 1 (fast)"), ("extreme", "Phase 2 (extreme)")):
            if phase_cell(cells[column]) != (hw[phase][0], hw[phase][1], tuple(hw[phase][2])):
                problems.append(f"{key}: {column} {cells[column]!r}, HARDWARE {hw[phase]}")
    return problems


def test_readme_hardware_table_is_launch_hardware():
    with open(README) as f:
        rows = readme_hardware_table(f.read())
    assert list(rows) == list(launch.HARDWARE)  # every row, in the table's order
    assert table_problems(rows, launch.HARDWARE) == []


def test_the_table_check_finds_a_difference():
    with open(README) as f:
        rows = readme_hardware_table(f.read())
    changed = {key: dict(hw) for key, hw in launch.HARDWARE.items()}
    changed["8xH100"]["price"] = 32.00
    changed["4xA100"]["extreme"] = (14, 4, (2.0, 3.5))
    changed["8xB200"]["gb"] = 192
    changed["2xH100"] = dict(changed["4xH100"])
    assert sorted(table_problems(rows, changed)) == sorted([
        "2xH100: in HARDWARE, not in the README",
        "8xH100: $/hour 31.60, HARDWARE 32.0",
        "4xA100: Phase 2 (extreme) '14 x 4, 2.0-3.0 s', HARDWARE (14, 4, (2.0, 3.5))",
        "8xB200: GPU memory 180 GB, HARDWARE 192 GB"])


# ---------------------------------------------------------------------------------------------------- commands
PROJECT_MODULE = re.compile(r"-m\s+((?:nanochat|scripts|dev)(?:\.[a-z_0-9]+)+)\b")


def documented_modules(texts):
    """Every project module a text runs as `python -m MODULE` (or `torchrun ... -m MODULE`)."""
    return {m for text in texts for m in PROJECT_MODULE.findall(text)}


def module_problem(module):
    """Why `python -m module` cannot run from the repository root, or None: it must be a file of the tree."""
    path = os.path.join(ROOT, *module.split(".")) + ".py"
    return None if os.path.isfile(path) else f"{module}: no {os.path.relpath(path, ROOT)}"


def test_every_documented_command_names_a_module_that_exists():
    """After a move of files every command in the README, the docs, the shell scripts and the code's messages still
    names a module that exists (python -m nanochat.dataset included)."""
    paths = [*markdown_files()[:-1], *glob.glob(os.path.join(ROOT, "**", "*.sh"), recursive=True),
             *glob.glob(os.path.join(ROOT, "nanochat", "**", "*.py"), recursive=True),
             *glob.glob(os.path.join(ROOT, "scripts", "*.py")), *glob.glob(os.path.join(ROOT, "dev", "*.py"))]
    texts = [open(p).read() for p in paths if ".venv" not in p]
    modules = documented_modules(texts)
    assert {"nanochat.dataset", "scripts.base_train", "scripts.serve"} <= modules
    assert [problem for problem in map(module_problem, sorted(modules)) if problem] == []


def test_the_command_check_finds_a_moved_module():
    text = "python -m nanochat.dataset --builtin\ntorchrun --standalone -m scripts.base_train -- --depth=4\n" \
           "python -m nanochat.gpt_old"
    assert documented_modules([text]) == {"nanochat.dataset", "scripts.base_train", "nanochat.gpt_old"}
    assert module_problem("nanochat.gpt_old") == "nanochat.gpt_old: no nanochat/gpt_old.py"
    assert module_problem("nanochat.dataset") is None
