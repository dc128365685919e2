"""dev/loop_gpu (issue 51 item 6): each part fits a 9-minute call by the plan, and the whole comparison runs end to end
on a CPU at toy size, writing bpb by supervision step, tokens/s and bpb by training step for every model. Part c
(issue 57 item 8) fits a 5-minute call by its plan from the H200's measured speeds, and runs its three models at once
at toy size."""

import os

import pytest

from dev import loop_gpu
from scripts import compare
from tests.support import forked
from tests.support.helpers import ROOT, base_train_child_in_process


@pytest.mark.parametrize("part", ["a", "b"])
def test_each_part_trains_in_a_few_minutes_of_one_h100_at_1e8_tokens(part):
    estimates = loop_gpu.plan(loop_gpu.compare_argv(part, "1e8", "out"))
    assert [name for name, *_ in estimates] == loop_gpu.PARTS[part]
    assert sum(seconds for *_, seconds in estimates) < 5 * 60  # of a 9-minute call: compile, evaluation, margin
    flops = dict((name, f) for name, f, _ in loop_gpu.plan(loop_gpu.compare_argv("all", "1e8", "out")))
    assert 0.8 < flops["plain24"] / flops["default"] < 1.25  # the deeper plain: about the recursion's FLOPs


def test_the_comparison_runs_at_toy_size_and_reports_every_model(base_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    # compare's children in this process (as processes: test_compare's tiny grid and part c's test below)
    monkeypatch.setattr(compare.lifecycle, "run_child", base_train_child_in_process)
    out = str(tmp_path / "out")
    toy = ["--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2", "--eval_tokens=64",
           "--compile=false", "--dtype=float32", "--device_type=cpu"]
    loop_gpu.main(["run", "all", "--tokens", "192", "--batch_tokens", "64", "--out", out, "--", *toy])
    text = open(os.path.join(out, "table.md")).read()
    for name in loop_gpu.PARTS["all"]:
        assert f"| {name} |" in text
    assert text.count(" 3:") == len(loop_gpu.PARTS["all"])  # each model's bpb at its last step (3 steps of 64 tokens)
    assert "n_sup=16" in open(os.path.join(out, "compare.md")).read()  # the recursion evaluated to 4N


def test_part_c_fits_a_5_minute_call_at_4e7_tokens_by_the_h200s_measured_speeds(capsys):
    rows, total = loop_gpu.plan_c("4e7")
    assert sorted(name for name, *_ in rows) == sorted(loop_gpu.PARTS["c"]) == ["holding", "loopnc", "plain24"]
    assert total <= loop_gpu.CALL_S["c"] == loop_gpu.PART_C["call_s"] == 300
    by_name = {name: (ready, train, done) for name, ready, train, done in rows}
    # training alone at the measured tokens/s: 4e7 tokens at 613k (holding) and 530k (plain24) tokens/s
    assert 65 < by_name["holding"][1] < 80 and 75 < by_name["plain24"][1] < 90
    # the GPU trains one model at a time: nothing finishes before its compile and its training are both done
    assert all(done >= ready + train - 1e-9 for ready, train, done in by_name.values())
    assert total == max(done for _, _, done in by_name.values())
    # and sequentially (every start, compile and training one after another) it would not fit: why the three run at once
    c = loop_gpu.PART_C
    assert c["prepare_s"] + sum(ready - c["prepare_s"] + train for ready, train, _ in by_name.values()) > 300
    loop_gpu.main(["plan", "c", "--tokens", "4e7"])
    out = capsys.readouterr().out
    assert "part c: ~" in out and "of a 300 s call" in out and all(f"{name} " in out for name in by_name)


def test_part_d_plans_the_levers_beside_the_default_in_one_7_minute_call():
    """Issue 57 item 4's GPU run: the new default beside the same with the consistency term at 1.0 and 0.3; equal in
    all but the lever."""
    rows, total = loop_gpu.plan_c("4e7", part="d")
    assert sorted(name for name, *_ in rows) == sorted(loop_gpu.PARTS["d"]) == ["consist", "consist03", "holding"]
    assert total <= loop_gpu.CALL_S["d"] == 420
    flags = {name: loop_gpu.CONFIGS[name].split() for name in loop_gpu.PARTS["d"]}
    assert flags["consist"] == flags["holding"] + ["--consistency_weight=1.0"]
    assert flags["consist03"] == flags["holding"] + ["--consistency_weight=0.3"]
    # the term costs no supervision steps: the plan gives the three one training time
    train = {name: train_s for name, _, train_s, _ in rows}
    assert train["holding"] == train["consist"] == train["consist03"]


# Part c's compare processes, each running its base_train in itself (a process start costs seconds here; compare's
# base_train as a process: test_compare's tiny grid)
COMPARE_WITH_CHILDREN_IN_PROCESS = (
    "import sys\nfrom scripts import compare\nfrom tests.support.helpers import base_train_child_in_process\n"
    "compare.lifecycle.run_child = base_train_child_in_process\ncompare.main(sys.argv[1:])")


def test_part_c_runs_its_models_at_once_at_toy_size(base_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    out = str(tmp_path / "out")
    toy = ["--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2", "--eval_tokens=64",
           "--compile=false", "--dtype=float32", "--device_type=cpu"]
    started = []

    # processes of their own, forked from the torch-preloaded server; a hard timeout: a hang fails the test instead
    # of stalling it
    def popen(cmd, **kwargs):
        started.append(cmd)
        assert cmd[1:3] == ["-m", "scripts.compare"], cmd
        return forked.Popen([cmd[0], "-c", COMPARE_WITH_CHILDREN_IN_PROCESS, *cmd[3:]], kill_after=300, **kwargs)

    monkeypatch.setattr(loop_gpu.subprocess, "Popen", popen)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", ROOT)
    loop_gpu.main(["run", "c", "--tokens", "128", "--batch_tokens", "64", "--out", out, "--", *toy])
    assert len(started) == 3
    assert sorted(next(a for a in cmd if a.startswith("--only=")) for cmd in started) == [
        "--only=holding", "--only=loopnc", "--only=plain24"]
    text = open(os.path.join(out, "table.md")).read()
    for name in loop_gpu.PARTS["c"]:
        assert f"| {name} |" in text and os.path.exists(os.path.join(out, name, "compare.md"))
    assert text.count(" 2:") == 3  # each model's bpb at its last step (2 steps of 64 tokens)
    assert "tokens/s are shares of it" in text
    assert "--eval_tokens=262144" in started[0]  # the trimmed evaluation (the toy's own flags come after and win)
