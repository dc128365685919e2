"""nanochat's command-line habits: dashed flags, a fixed default total batch over any number of processes, WANDB_RUN."""

import pytest

from nanochat.cli import underscore_flags
from scripts import base_loss, base_train, launch
from nanochat import train_config

TINY = ["--depth=1", "--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2", "--device_type=cpu"]


def parsed(argv, world_size=1):
    """base_train's parsed flags, less the command line they came from."""
    args = vars(train_config.parse_args(argv, world_size=world_size, check_hardware=False))
    args.pop("argv")
    return args


def test_dashed_flags_parse_the_same_as_underscores():
    underscored = ["--depth=2", "--device_batch_size=4", "--max_seq_len", "64", "--n_sup_train=3",
                   "--gradient_accumulation_steps=2", "--detach_between_steps", "--model_tag=my_run", "--device_type=cpu"]
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
        train_config.parse_args(TINY + ["--device-batch=4"], check_hardware=False)
    assert "unknown flag --device_batch; did you mean --device_batch_size?" in str(e.value.code)


def test_launch_sees_dashed_user_flags_as_its_own(monkeypatch, capsys):
    """The launcher keeps the table's batch unless the user sets one: --device-batch-size must count as set."""
    calls = []
    monkeypatch.setattr(launch, "train", lambda hardware, phase, extra: calls.append(extra) or 0)
    assert launch.main(["train", "8xH100", "fast", "--device-batch-size=4"]) == 0
    assert launch.user_flag_names(calls[0]) == {"device_batch_size"}


def test_the_default_total_batch_is_fixed_and_the_accumulation_follows_the_processes():
    """The compute-optimal batch depends on the model and its horizon, not on the processes (1 or 8 GPUs train the
    same model); its value is tests/test_train_config.py's."""
    one, two = parsed(TINY, world_size=1), parsed(TINY, world_size=2)
    assert one["total_batch_size"] == two["total_batch_size"]
    assert one["grad_accum"] == 2 * two["grad_accum"] == one["total_batch_size"] // (2 * 32)


def test_one_and_two_processes_read_the_same_data_ranks_in_each_step():
    """The loaders of process r read data ranks data_ranks(args, r) of world_size x grad_accum; with a fixed total
    batch, 1 and 2 processes split the stream into the same ranks and read all of them every step. (That equal data
    ranks give equal training is tests/test_base_train.py's two-process Gloo test.)"""
    geometry = ["--max_seq_len=32", "--device_batch_size=8192", "--total_batch_size=524288"]  # 2 accumulation steps on 1 process, 1 on 2
    reads = {}
    for world in (1, 2):
        args = train_config.parse_args(TINY + geometry, world_size=world, check_hardware=False)
        reads[world] = ([train_config.data_ranks(args, rank) for rank in range(world)], world * args.grad_accum)
    assert reads[1] == ([[0, 1]], 2)
    assert reads[2] == ([[0], [1]], 2)


@pytest.mark.parametrize("world, flags, message", [
    (3, ["--total_batch_size=524288"], "--total_batch_size=524288 is not a multiple of processes x device_batch_size x "
                                       "max_seq_len = 3 x 2 x 32 = 192; pass --total_batch_size=524352"),
    (1, ["--device_batch_size=16385", "--total_batch_size=524288"], "pass --total_batch_size=524320"),  # more than the whole batch in one step
    (1, ["--total_batch_size=100"], "--total_batch_size=100 is not a multiple"),
    (1, ["--total_batch_size=128", "--gradient_accumulation_steps=4"], "give only one of them"),
])
def test_a_batch_that_does_not_divide_names_the_flag_to_pass(world, flags, message):
    with pytest.raises(SystemExit) as e:
        train_config.parse_args(TINY + flags, world_size=world, check_hardware=False)
    assert message in str(e.value.code)


def test_explicit_accumulation_sets_the_batch():
    args = parsed(TINY + ["--gradient_accumulation_steps=3"], world_size=2)
    assert (args["grad_accum"], args["total_batch_size"]) == (3, 2 * 2 * 32 * 3)


def test_wandb_run_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("WANDB_RUN", "from_env")
    assert parsed(TINY)["run"] == "from_env"
    assert parsed(TINY + ["--run=from_flag"])["run"] == "from_flag"
    monkeypatch.delenv("WANDB_RUN")
    assert parsed(TINY)["run"] == "dummy"
