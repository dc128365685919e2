"""Every bad value of base_train, base_loss and the launch scripts: a non-zero exit, one line that says what is wrong
and what to do, and nothing written. In process (the parsers run before anything is built), so each takes
milliseconds; base_loss with more supervision steps than trained must work and write its results."""

import json
import os

import pytest

from scripts import base_loss, base_train, launch
from tests.support.helpers import OVERRIDES, TINY, tree

TRAIN = [
    ("--eval_every=-1", "--eval_every=-1 must be >= 0"),
    ("--sample_every=-1", "--sample_every=-1 must be >= 0"),
    ("--save_every=-2", "--save_every=-2 must be >= 0"),
    ("--save_every_minutes=-1", "--save_every_minutes=-1.0 must be >= 0"),
    ("--keep_last=-1", "--keep_last=-1 must be >= 0"),
    ("--matrix_lr=-0.02", "--matrix_lr=-0.02 must be >= 0"),
    ("--matrix_lr=nan", "--matrix_lr=nan must be >= 0"),
    ("--embedding_lr=-1", "--embedding_lr=-1.0 must be >= 0"),
    ("--unembedding_lr=-1", "--unembedding_lr=-1.0 must be >= 0"),
    ("--weight_decay=-1", "--weight_decay=-1.0 must be >= 0"),
    ("--grad_clip=-1", "--grad_clip=-1.0 must be >= 0"),
    ("--ema_decay=1", "--ema_decay: '1': a decay in [0, 1)"),
    ("--ema_decay=fast", "--ema_decay: 'fast': a decay in"),
    ("--n_embd=0", "--n_embd=0 must be >= 1"),
    ("--n_head=0", "--n_head=0 must be >= 1"),
    ("--target_flops=0", "--target_flops=0.0 must be > 0"),
    ("--target_param_data_ratio=-1", "--target_param_data_ratio=-1.0 must be > 0"),
    ("--max_hours=0", "--max_hours=0.0 must be > 0"),
    ("--max_seq_len=0", "--max_seq_len=0 must be >= 1"),
    ("--overwrite --resume", "give one of them"),
    ("--backup_dir=nosuchproto://bucket", "--backup_dir=nosuchproto://bucket: ValueError: Protocol not known"),
    ("--device_batch=4", "unknown flag --device_batch; did you mean --device_batch_size?"),
    ("--total_batch_size=100", "not a multiple of"),
    ("--preset=insane", "valid presets: uniform, moderate, aggressive, extreme"),
    ("--n_head=5", "n_embd=32 is not divisible by n_head=5"),
    ("--model_tag=nothing_here --resume", "no checkpoint found for model tag 'nothing_here'"),
    ("--device_type=cuda", "not available on this machine"),
]
LOSS = [
    ("--device_batch_size=0", "--device_batch_size=0 must be >= 1"),
    ("--split_tokens=0", "--split_tokens=0 must be >= 1"),
    ("--n_sup=0", "--n_sup=0 must be >= 1"),
    ("--step=abc", "'abc': use 'latest', 'best' or a step number"),
    ("--max_seq_len=100000", "--max_seq_len=100000 is longer than the 32-token context"),
]
LAUNCH = [
    ({"VOCAB_SIZE": "10"}, "VOCAB_SIZE='10' must be an integer from 265 to 1048576"),
    ({"VOCAB_SIZE": "lots"}, "VOCAB_SIZE='lots' must be an integer from 265 to 1048576"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}, "NODE_RANK='2' must be an integer from 0 to 1"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "abc"},
     "MASTER_PORT='abc' must be an integer from 1 to 65535"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "70000"},
     "MASTER_PORT='70000' must be an integer from 1 to 65535"),
]
CASES = ([("base_train", flags, message) for flags, message in TRAIN] +
         [("base_loss", flags, message) for flags, message in LOSS] +
         [("launch", env, message) for env, message in LAUNCH])


@pytest.fixture(scope="module")
def four_step_model(base_dir):
    """A 4-supervision-step checkpoint (tag 'four') in the shared base directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", base_dir)
        base_train.main(TINY + ["--n_sup_train=4", "--num_iterations=1", "--eval_every=0", "--model_tag=four"])
    return base_dir


def run_tool(tool, value, base_dir, monkeypatch):
    """(exit code, the message lines the user sees) of one invocation."""
    if tool == "launch":
        for name in OVERRIDES:
            monkeypatch.delenv(name, raising=False)
        for name, v in {"DEVICE_TYPE": "cpu", "NPROC": "2", "DATASET": "builtin", **value}.items():
            monkeypatch.setenv(name, v)
        monkeypatch.setattr(launch, "tokenizer_vocab", lambda: None)  # as on a new machine: VOCAB_SIZE is read
        return launch.main(["train", "8xH100", "fast", "--depth=1"]), []
    main = base_train.main if tool == "base_train" else base_loss.main
    argv = (TINY + ["--num_iterations=2", "--model_tag=bad"] if tool == "base_train" else
            ["--model_tag=four", "--device_type=cpu"]) + value.split()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    code = exit_info.value.code  # a message (printed by Python at exit, status 1), or a status after a printed line
    return (1, [code]) if isinstance(code, str) else (code, [])


@pytest.mark.parametrize("tool, value, message", CASES, ids=[f"{t}-{v}" for t, v, _ in CASES])
def test_a_bad_value_is_one_line_and_writes_nothing(tool, value, message, four_step_model, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", four_step_model)
    before = tree(four_step_model)
    code, raised = run_tool(tool, value, four_step_model, monkeypatch)
    out, err = capsys.readouterr()
    lines = [line for line in (err.splitlines() + raised) if line.strip()]
    assert code not in (0, None)
    assert len(lines) == 1 and message in lines[0], lines
    assert tree(four_step_model) == before


def test_base_loss_past_the_trained_steps_works_and_writes_results(four_step_model, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", four_step_model)
    results = base_loss.main(["--model_tag=four", "--device_type=cpu", "--n_sup=9", "--device_batch_size=2",
                              "--split_tokens=128", "--sample_tokens=2"])
    assert "9 supervision steps, past the 4 the model was trained with" in capsys.readouterr().out
    path = os.path.join(four_step_model, "base_checkpoints", "four", "base_loss_step000001.json")
    with open(path) as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(results)) and saved["n_sup"] == 9 and len(saved["val_bpb"]) == 9
