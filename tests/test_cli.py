"""nanochat/cli.py: dashed flags work as well as underscored ones, in every entry point's parser."""

import importlib
import os
import re
import sys
from pathlib import Path

import pytest
import tomllib

from nanochat.cli import EXTRAS, ExitCode, install_command, underscore_flags
from nanochat.model.gpt import REFINEMENT_PRESETS
from nanochat.train import config as train_config
from nanochat.train.planning import MODEL_FLAGS
from scripts import base_loss, chat_sft, launch
from tests.support.helpers import ROOT, TINY_SHAPE, parsed


def test_dashed_flags_parse_the_same_as_underscores():
    underscored = ["--depth=2", "--device_batch_size=4", "--max_seq_len", "64", "--n_sup_train=3",
                   "--gradient_accumulation_steps=2", "--detach_between_steps", "--model_tag=my_run",
                   "--device_type=cpu"]
    dashed = ["--depth=2", "--device-batch-size=4", "--max-seq-len", "64", "--n-sup-train=3",
              "--gradient-accumulation-steps=2", "--detach-between-steps", "--model-tag=my_run", "--device-type=cpu"]
    assert parsed(dashed) == parsed(underscored)
    assert parsed(dashed)["model_tag"] == "my_run"  # values keep their underscores (and dashes)
    assert base_loss.parse_args(["--model-tag=d4", "--device-batch-size=2"]).device_batch_size == 2


def test_dashes_are_only_rewritten_in_flag_names():
    assert underscore_flags(["--prompt=a-b", "--n-sup", "2", "-x", "--", "--keep-me"]) == \
        ["--prompt=a-b", "--n_sup", "2", "-x", "--", "--keep-me"]


def test_a_misspelled_dashed_flag_gets_the_suggestion():
    with pytest.raises(SystemExit) as e:
        train_config.parse_args(TINY_SHAPE + ["--device-batch=4"], check_hardware=False)
    assert "unknown flag --device_batch; did you mean --device_batch_size?" in str(e.value.code)


def test_launch_sees_dashed_user_flags_as_its_own(monkeypatch, capsys):
    """The launcher keeps the table's batch unless the user sets one: --device-batch-size must count as set."""
    calls = []
    monkeypatch.setattr(launch, "train", lambda hardware, phase, extra: calls.append(extra) or 0)
    assert launch.main(["train", "8xH100", "fast", "--device-batch-size=4"]) == 0
    assert launch.user_flag_names(calls[0]) == {"device_batch_size"}


# ---------------------------------------------------------------------------------------------------- --help
# the entry points whose --help gives every flag's default (nanochat.cli.DefaultsHelp)
DEFAULTS_SHOWN = ["base_train", "chat_sft", "base_loss", "base_eval", "base_sample", "chat_eval", "halt_train",
                  "tok_train", "tok_eval"]


def help_text(script, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"scripts.{script}").main(["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def flag_help(text):
    """{--flag: its help on one line} of a --help text."""
    blocks, flag = {}, None
    for line in text.splitlines():
        match = re.match(r"  (--\w+)", line)
        if match:
            flag = match.group(1)
        elif not line.startswith("   "):  # a group's title or a blank line ends the flag's block
            flag = None
        if flag:
            blocks[flag] = blocks.get(flag, "") + " " + line
    return {flag: " ".join(block.split()) for flag, block in blocks.items() if flag != "--help"}


@pytest.mark.parametrize("script", DEFAULTS_SHOWN)
def test_every_flag_says_its_default_once_and_none_is_a_bare_none(script, capsys):
    flags = flag_help(help_text(script, capsys))
    assert len(flags) >= 2
    for flag, text in flags.items():
        if flag == "--data" and script == "chat_sft":  # required: no default
            assert "(default" not in text
            continue
        assert text.count("(default:") == 1, (flag, text)  # not argparse's second: "(default: x) (default: )"
        assert "(default: None)" not in text and "(default: )" not in text, (flag, text)


def test_base_train_help_shows_the_model_defaults_the_run_takes(capsys):
    """Each model flag's help names the value an unset flag gives the run, read from the parsed run's config."""
    flags = flag_help(help_text("base_train", capsys))
    run = train_config.parse_args(["--depth=2", "--device_type=cpu"], check_hardware=False).model_config
    for name in MODEL_FLAGS:
        shown = re.search(r"\(default: (?:--preset's, else )?([^,)]+)", flags[f"--{name}"]).group(1)
        expected = "--n_sup_train's" if name == "n_sup_inference" else str(run[name])
        assert shown == expected, (name, flags[f"--{name}"])
    assert run["n_sup_inference"] == run["n_sup_train"]
    preset = re.search(r"\(default: none: gpt.py's (\S+) and (\S+?), which are (\w+)\)", flags["--preset"])
    values = (run["supervision_weight_base"], run["improvement_reward_scale"])
    assert (float(preset.group(1)), float(preset.group(2))) == values
    assert REFINEMENT_PRESETS[preset.group(3)] == values  # the preset named is the one gpt.py's values equal
    assert flags["--device_type"].endswith("(default: autodetect: cuda, mps, cpu)")


def test_chat_sft_help_names_what_an_unset_flag_takes_from_the_base_run(capsys):
    text = " ".join(help_text("chat_sft", capsys).split())
    assert all(f"--{name}" in text for name in chat_sft.INHERITED)
    assert all(f"--{name}={value}" in text for name, value in chat_sft.SFT_DEFAULTS.items())


# ---------------------------------------------------------------------------------------------------- optional packages
def says_install(message, extra):
    """The message is one line, ending in the command that installs the extra into this Python."""
    message = message.strip()
    assert "\n" not in message, message
    assert message.endswith(f"install it with: {install_command(extra)}"), message


def test_the_install_command_uses_this_interpreter_and_this_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", os.path.join(ROOT, ".venv", "bin", "python"))
    monkeypatch.chdir(ROOT)
    assert install_command("serve") == ".venv/bin/python -m pip install -e '.[serve]'"
    monkeypatch.chdir(tmp_path)  # elsewhere: whole paths
    assert install_command("plot") == f"{ROOT}/.venv/bin/python -m pip install -e '{ROOT}[plot]'"


def test_every_extra_named_is_one_of_pyproject_and_holds_the_package():
    extras = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {extra: {re.split(r"[<>=\[ ]", req)[0].lower().replace("-", "_") for req in reqs}
                for extra, reqs in extras.items()}
    brought_by = {"starlette": "fastapi", "pydantic": "fastapi", "h11": "uvicorn", "pynvml": "nvidia_ml_py",
                  "tokenizers": "transformers"}  # imported under another name, or a dependency of the one declared
    for module, extra in EXTRAS.items():
        assert brought_by.get(module, module) in declared[extra], (module, extra)


@pytest.mark.parametrize("script,module,extra", [("base_eval", "lm_eval", "eval"), ("export_hf", "transformers", "hf"),
                                                 ("serve", "uvicorn", "serve")])
def test_an_entry_point_whose_import_needs_an_extra_names_it(monkeypatch, script, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # not installed
    monkeypatch.delitem(sys.modules, f"scripts.{script}", raising=False)  # imported again, from the top
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"scripts.{script}")
    says_install(e.value.code, extra)


class FakeHealth:
    def json(self):
        return {"model_tag": "t", "step": 1, "n_sup_inference": 1, "n_sup_max": 2, "n_sup_train": 1}


@pytest.mark.parametrize("module", ["httpx", "lm_eval"])
def test_chat_eval_server_without_its_clients_names_the_extra(monkeypatch, capsys, module):
    from scripts import chat_eval
    if module == "lm_eval":  # the server answers; lm-eval, which asks it the questions, is missing
        import httpx
        monkeypatch.setattr(httpx, "get", lambda url, timeout, headers=None: FakeHealth())
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(SystemExit) as e:
        chat_eval.main(["--server=http://127.0.0.1:9", "--limit=2", "--device_type=cpu"])
    assert e.value.code == ExitCode.USAGE
    says_install(capsys.readouterr().err, "serve" if module == "httpx" else "eval")


def test_the_plots_without_matplotlib_name_the_extra(monkeypatch, tmp_path, capsys):
    from dev import halting_curve
    from nanochat.eval.chat_eval import scored
    from scripts import chat_eval, compare, plot_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    (tmp_path / "metrics.jsonl").write_text("")
    for call in (lambda: plot_run.main([str(tmp_path)]), lambda: compare.plot({}, str(tmp_path / "c.png")),
                 lambda: halting_curve.plot([], "title", str(tmp_path / "h.png"))):
        with pytest.raises(SystemExit) as e:
            call()
        says_install(str(e.value.code), "plot")
    # chat_eval goes on without its plot (a model's answers, here a constant one): a note says what would make it
    monkeypatch.setattr(chat_eval, "in_process", lambda args, items: (
        scored(items, [[("seven", True)] * len(items)], 8), "t", 1, 1))
    chat_eval.main(["--limit=2", "--device_type=cpu", f"--out={tmp_path}"])
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("no plot:")]
    assert len(note) == 1
    says_install(note[0], "plot")


def test_a_training_monitor_without_its_package_is_off_with_the_extra_named(monkeypatch, tmp_path, capsys):
    from nanochat.eval.metrics import MetricsLog
    monkeypatch.setitem(sys.modules, "wandb", None)
    run_config = train_config.parse_args(["--depth=2", "--device_type=cpu", "--run=r"], check_hardware=False)
    MetricsLog(str(tmp_path), run_config, rank=0, resume_step=None)
    says_install(capsys.readouterr().out.split("; metrics.jsonl has everything")[0], "wandb")


def test_no_source_tells_a_bare_pip_install():
    """Every install hint in the library and the scripts runs pip through an interpreter (cli.install_command)."""
    for path in sorted(Path(ROOT).glob("scripts/*.py")) + sorted(Path(ROOT).glob("nanochat/**/*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"(?<!-m )pip install", line), f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
