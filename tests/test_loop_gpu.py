"""dev/loop_gpu (issue 51 item 6): each part fits a 9-minute call by the plan, and the whole comparison runs end to end
on a CPU at toy size, writing bpb by supervision step, tokens/s and bpb by training step for every model."""

import os
import subprocess

import pytest

from dev import loop_gpu
from scripts import compare
from tests.support import processes


@pytest.mark.parametrize("part", ["a", "b"])
def test_each_part_trains_in_a_few_minutes_of_one_h100_at_1e8_tokens(part):
    estimates = loop_gpu.plan(loop_gpu.compare_argv(part, "1e8", "out"))
    assert [name for name, *_ in estimates] == loop_gpu.PARTS[part]
    assert sum(seconds for *_, seconds in estimates) < 5 * 60  # of a 9-minute call: compile, evaluation, margin
    flops = dict((name, f) for name, f, _ in loop_gpu.plan(loop_gpu.compare_argv("all", "1e8", "out")))
    assert 0.8 < flops["plain24"] / flops["default"] < 1.25  # the deeper plain: about the recursion's FLOPs


def test_the_comparison_runs_at_toy_size_and_reports_every_model(base_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)

    def run_child(cmd, env=None):  # a hang fails the test instead of stalling it
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, text=True)
        return processes.finish(proc, timeout=300).returncode, None

    monkeypatch.setattr(compare.lifecycle, "run_child", run_child)
    out = str(tmp_path / "out")
    toy = ["--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2", "--eval_tokens=64",
           "--compile=false", "--dtype=float32", "--device_type=cpu"]
    loop_gpu.main(["run", "all", "--tokens", "192", "--batch_tokens", "64", "--out", out, "--", *toy])
    text = open(os.path.join(out, "table.md")).read()
    for name in loop_gpu.CONFIGS:
        assert f"| {name} |" in text
    assert text.count(" 3:") == len(loop_gpu.CONFIGS)  # each model's bpb at its last step (3 steps of 64 tokens)
    assert "n_sup=16" in open(os.path.join(out, "compare.md")).read()  # the recursion evaluated to 4N
