"""nanochat/cli.py: dashed flags work as well as underscored ones, in every entry point's parser."""

import importlib
import re

import pytest

from nanochat.cli import underscore_flags
from nanochat.model.gpt import REFINEMENT_PRESETS
from nanochat.train import config as train_config
from nanochat.train.planning import MODEL_FLAGS
from scripts import base_loss, chat_sft, launch
from tests.support.helpers import TINY_SHAPE, parsed


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
