"""dev/runcpu.sh and dev/runcpu_chat.sh, the CPU pipeline and its chat stage: their closing summaries print the next
commands with the base directory and the tags the pipeline made, and every printed command parses as its script's."""

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from nanochat.serve.api import ChatCompletionRequest, parse_request
from scripts import base_loss, base_sample, serve
from tests.support.helpers import ROOT

PARSERS = {"scripts.base_sample": base_sample.parse_args, "scripts.base_loss": base_loss.parse_args,
           "scripts.serve": serve.parse_args}
BASE_DIR = "/tmp/a home/nanochat-cpu"  # a space: the export line must quote it


def closing_summary(script):
    """The script's closing summary as it prints, its tags at their defaults: the script's own text from the marker
    to the end, run by bash after the lines that set the tags."""
    text = (Path(ROOT) / "dev" / script).read_text()
    tags = "\n".join(re.findall(r"^(?:MODEL_TAG|SFT_TAG)=.*$", text, re.M))
    prelude = f"py=.venv/bin/python\nstart=$(date +%s)\nNANOCHAT_BASE_DIR={shlex.quote(BASE_DIR)}\n{tags}\n"
    block = text[text.index("# the closing summary"):]
    proc = subprocess.run(["bash", "-c", prelude + block], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return text, proc.stdout


def commands(summary):
    """(module, its arguments) of each printed `.venv/bin/python -m scripts.X` line."""
    found = []
    for line in summary.splitlines():
        if line.startswith("  .venv/bin/python -m "):
            words = shlex.split(line, comments=True)
            found.append((words[2], words[3:]))
    return found


@pytest.mark.parametrize("script,tag,made_by", [("runcpu.sh", "cpu_d4", '--model_tag="$MODEL_TAG"'),
                                                ("runcpu_chat.sh", "cpu_d4_sft", '--sft_tag="$SFT_TAG"')])
def test_the_closing_summary_prints_commands_that_find_the_models_it_made(script, tag, made_by, monkeypatch):
    text, summary = closing_summary(script)
    assert made_by in text  # the tag below is the one the pipeline trained under
    export = [line for line in summary.splitlines() if line.startswith("  export NANOCHAT_BASE_DIR=")]
    assert len(export) == 1  # and a shell that runs it gets the directory back, its space and all
    echoed = subprocess.run(["bash", "-c", export[0] + '; printf %s "$NANOCHAT_BASE_DIR"'], capture_output=True,
                            text=True, timeout=30)
    assert echoed.stdout == BASE_DIR
    found = commands(summary)
    assert {module for module, _ in found} >= ({"scripts.serve"} if script == "runcpu_chat.sh" else set(PARSERS))
    monkeypatch.setenv("NANOCHAT_BASE_DIR", BASE_DIR)
    for module, argv in found:
        args = PARSERS[module](argv)  # the flags exist and their values parse
        assert args.model_tag == tag, (module, argv)


def test_the_chat_stage_prints_a_request_the_server_takes():
    _, summary = closing_summary("runcpu_chat.sh")
    curl = summary[summary.index("  curl "):].split("\n  (")[0].replace("\\\n", " ")
    words = shlex.split(curl)
    assert words[words.index("-s") + 1] == "http://127.0.0.1:8000/v1/chat/completions"  # serve's default port
    request = parse_request(json.loads(words[words.index("-d") + 1]), ChatCompletionRequest)
    assert request.messages[0].content == "What is two plus three?" and request.temperature == 0
