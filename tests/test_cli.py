"""nanochat/cli.py: dashed flags work as well as underscored ones, in every entry point's parser."""

import pytest

from nanochat.cli import underscore_flags
from nanochat.train import config as train_config
from scripts import base_loss, launch
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
