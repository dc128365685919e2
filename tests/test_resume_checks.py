"""What --resume checks before it writes anything: the process count the checkpoint was written by (1 and 2 Gloo
processes under torchrun), the data it was trained on (its fingerprint), and the schedule it followed."""

import json
import os

import pytest

from tests.helpers import TINY, ckpt_dir, tree
from tests.test_base_train import run

FLAGS = TINY + ["--eval_every=0", "--save_every=1", "--keep_last=0", "--num_iterations=2"]


def error_lines(proc):
    """base_train's own error lines (torchrun adds its report of the failed workers around them)."""
    return [line for line in proc.stderr.splitlines() if line.startswith("base_train:")]


@pytest.mark.parametrize("saved, resumed", [(1, 2), (2, 1)])
def test_resuming_on_another_process_count_refuses_naming_both(base_dir, saved, resumed):
    tag = f"procs{saved}to{resumed}"
    run(base_dir, *FLAGS, f"--model_tag={tag}", torchrun=saved == 2)
    before = tree(base_dir)
    proc = run(base_dir, *FLAGS, "--num_iterations=4", f"--model_tag={tag}", "--resume", torchrun=resumed == 2,
               check=False)
    assert proc.returncode != 0
    lines = error_lines(proc)
    assert lines and len(set(lines)) == 1, proc.stderr[-3000:]  # every rank says the same one line
    processes = "1 process" if saved == 1 else "2 processes"
    assert f"checkpoint step 2 of '{tag}' was written by {processes} and this run has {resumed}" in lines[0]
    launch = "python -m scripts.base_train" if saved == 1 else "torchrun --nproc_per_node=2 -m scripts.base_train"
    assert launch in lines[0] and "--device_batch_size=2 --gradient_accumulation_steps=1" in lines[0]
    output = proc.stdout + proc.stderr
    assert "unreadable" not in output and "skipping" not in output  # the newest checkpoint is not called damaged
    if resumed == 1:
        assert proc.stderr.strip().splitlines() == lines
    assert tree(base_dir) == before
