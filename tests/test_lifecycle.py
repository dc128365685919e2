"""The run lifecycle: stop and save decisions agreed by every rank (2 Gloo processes, forked as torchrun would start
them, or under torchrun where torchrun's part is the claim; each with a hard timeout so a hang fails the test), SIGTERM
from the launcher, a failing evaluation on one rank, the signal handler and the budget clock."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from nanochat.train import lifecycle
from scripts.base_train import main as base_train_main
from tests.support import forked
from tests.support.helpers import ROOT, TINY, ckpt_dir, exit_code, finish, read_until, tree, weights
from tests.test_base_train import in_process

FLAGS = TINY + ["--eval_every=0", "--keep_last=0"]


def torchrun(base_dir, *args):
    env = {**os.environ, "NANOCHAT_BASE_DIR": base_dir, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ranks(base_dir, *args):
    """2 ranks as torchrun starts them, forked from the torch-preloaded server: for claims about two ranks, not about
    torchrun (its signal and its failure report keep a real torchrun above)."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": base_dir, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return forked.Ranks([sys.executable, *args], env=env, cwd=ROOT, stderr=subprocess.STDOUT)


def base_train(base_dir, *flags):
    return torchrun(base_dir, "-m", "scripts.base_train", "--", *flags)


def checkpoints(base_dir, tag):
    return sorted(int(d[5:]) for d in os.listdir(ckpt_dir(base_dir, tag)) if d.startswith("step_"))


def test_a_write_that_fails_on_rank_0_stops_every_rank_together_with_one_line_each(base_dir):
    run_dir = ckpt_dir(base_dir, "fullog2")
    rc, out = finish(torchrun(base_dir, os.path.join("tests", "support", "write_failure_worker.py"), run_dir, *FLAGS,
                              "--num_iterations=6", "--model_tag=fullog2"))
    assert rc != 0
    assert out.count("base_train: ") == 2, out[-3000:]  # a line from each rank
    assert f"base_train: cannot write {run_dir}/metrics.jsonl: no space left on device" in out
    assert "base_train: rank 1 stopped with rank 0, which could not write the run's files (its line says which and " \
           "why)\n" in out
    # no worker was left in a collective with a peer gone: the one traceback is torchrun's report of the exit codes
    assert "Connection closed" not in out and out.count("Traceback") == 1 and "ChildFailedError" in out, out[-3000:]
    assert "exitcode  : 5" in out, out[-3000:]


@pytest.fixture(scope="module")
def budget_run(base_dir):
    """(exit code, output, the step it stopped at) of one 2-rank run whose validation loader fails on rank 1
    (lifecycle_worker.py), stopped by its budget: the budget's test and the failing evaluation's read it."""
    rc, out = finish(ranks(base_dir, os.path.join("tests", "support", "lifecycle_worker.py"), *FLAGS,
                              "--num_iterations=100000", "--max_hours=0.0005", "--save_every_minutes=0",
                              "--eval_every=2", "--model_tag=budget2"))
    stop = [line for line in out.splitlines() if line.startswith("budget spent (--max_hours=0.0005) at step")]
    assert rc == 0 and len(stop) == 1, out[-3000:]
    return rc, out, int(stop[0].split("at step ")[1].split(":")[0])


def test_budget_stop_ends_both_ranks_with_one_checkpoint(base_dir, budget_run):
    _, out, stopped_at = budget_run
    assert 0 < stopped_at < 100000 and checkpoints(base_dir, "budget2") == [stopped_at], out[-3000:]


def test_an_evaluation_failing_on_one_rank_is_skipped_by_both(budget_run):
    _, out, at = budget_run
    skipped = [line for line in out.splitlines() if line.startswith("WARNING: evaluation failed")]
    # each evaluation once (from rank 0), naming rank and cause: steps 0, 2, 4, ... and the step the budget stopped at
    assert len(skipped) == len(range(0, at + 1, 2)) + at % 2, out[-3000:]
    assert skipped[0] == ("WARNING: evaluation failed on rank 1: ValueError: injected: this rank has no validation "
                          "row group; skipped on every rank, training goes on")
    assert f"step {at:05d}/100000" in out  # training went on to the budget


def test_sigterm_to_torchrun_saves_exits_and_resumes_bit_identically(base_dir):
    # enough steps that the signal lands mid-run: with saves in the background a step takes ~25 ms, and 8 steps
    # were seen to finish before the signal reached the workers
    steps = 60
    flags = [*FLAGS, f"--num_iterations={steps}", "--save_every_minutes=0"]
    # the reference, alongside; with timed saves (--save_every_minutes=0.01), which change nothing it trains
    straight = base_train(base_dir, *flags, "--save_every_minutes=0.01", "--model_tag=term_straight")
    proc = base_train(base_dir, *flags, "--model_tag=term")
    read_until(proc, "step 00003/")
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc)
    stopped = time.time() - t0
    assert "SIGTERM received: finishing the current batch, then saving" in out  # at once, from the handler
    line = next((l for l in out.splitlines() if "SIGTERM received (rank" in l), None)
    assert line and line.endswith(": saving and stopping"), out[-3000:]
    at = int(line.split("at step ")[1].split(":")[0])
    assert 3 <= at < steps and checkpoints(base_dir, "term") == [at], out[-3000:]
    assert out.count(f"stopped at step {at} by SIGTERM received") == 2  # both workers exited on their own, saying so
    assert "Traceback" not in out.split("SIGTERM received")[1].split("torch.distributed.elastic")[0]
    assert stopped < 30, stopped  # well inside torchrun's 30 s before it SIGKILLs
    resumed = base_train(base_dir, *flags, "--model_tag=term", "--resume")
    rc, out = finish(resumed)
    assert rc == 0 and f"resumed term from step {at}" in out, out[-3000:]
    rc, out = finish(straight)
    assert rc == 0, out[-3000:]
    saved = checkpoints(base_dir, "term_straight")
    assert len(saved) >= 2 and saved[-1] == steps, saved  # timed saves on the way, completed on both ranks, the final
    a, b = weights(base_dir, "term_straight", steps), weights(base_dir, "term", steps)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------------- in process
def test_signals_ask_to_stop_and_repeats_count_once():
    with lifecycle.StopSignals() as signals:
        assert signals.received is None
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a forwarded copy: still alive
        assert signals.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored


def test_a_later_second_signal_exits_at_once():
    code = ("import os, signal, time\nfrom nanochat.train import lifecycle\nwith lifecycle.StopSignals() as s:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n    s.first_at -= 60\n    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(5)\nprint('survived')")
    proc = forked.run([sys.executable, "-c", code], 60, cwd=ROOT)
    assert proc.returncode == -signal.SIGINT and "survived" not in proc.stdout


def test_flags_budgets_and_save_cadence():
    control = lifecycle.RunControl(max_hours=1.0, max_cost=None, save_every_minutes=30, prior_seconds=3599.0,
                                   price_per_hour=0, signals=lifecycle.StopSignals())
    values, flags = control.reduce(torch.tensor([1.0, 2.0]))
    assert values == [1.0, 2.0] and flags == {"signal": [], "budget": [], "save_time": [], "data": [], "write": []}
    control.prior_seconds = 3600.0  # the hour is spent, counting the run's time before its resume
    control.last_save -= 31 * 60
    flags = control.agree(torch.device("cpu"))
    assert flags == {"signal": [], "budget": [0], "save_time": [0], "data": [], "write": []}
    assert control.reduce(torch.zeros(0), data_failed=True)[1]["data"] == [0]
    assert control.reduce(torch.zeros(0), write_failed=True)[1]["write"] == [0]
    assert control.stop_reason(flags) == "budget spent (--max_hours=1.0)" and control.exit_code(flags) == 0
    control.signals.received = signal.SIGTERM
    flags = control.agree(torch.device("cpu"))
    assert control.stop_reason(flags) == "SIGTERM received (rank 0)" and control.exit_code(flags) == 143


def test_the_allocator_gets_expandable_segments_unless_the_user_set_one(monkeypatch):
    from nanochat.train.lifecycle import configure_cuda_allocator
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    configure_cuda_allocator()
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    configure_cuda_allocator()
    assert "PYTORCH_ALLOC_CONF" not in os.environ


def test_the_garbage_collector_is_frozen_after_the_first_step_and_collected_by_hand(monkeypatch):
    import gc

    from nanochat.train import lifecycle
    collected = []
    monkeypatch.setattr(gc, "collect", lambda: collected.append(1) or 0)
    try:
        lifecycle.tame_garbage_collector(first_step=True, step=1)
        assert not gc.isenabled() and gc.get_freeze_count() > 0 and collected == [1]
        lifecycle.tame_garbage_collector(first_step=False, step=2)
        assert collected == [1]
        lifecycle.tame_garbage_collector(first_step=False, step=lifecycle.GC_EVERY_STEPS)
        assert collected == [1, 1]
    finally:
        gc.unfreeze()
        gc.enable()


# ---------------------------------------------------------------------------------------------------- one run per tag
def one_process(base_dir, *flags):
    """base_train in a process of its own (forked: the lock's claim is another process's pid, not a fresh start)."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": base_dir, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return forked.Popen([sys.executable, "-m", "scripts.base_train", *flags], cwd=ROOT, env=env,
                        stderr=subprocess.STDOUT)


def test_a_second_run_on_a_live_tag_refuses_and_a_killed_run_leaves_no_lock(base_dir):
    flags = [*FLAGS, "--num_iterations=100000", "--save_every=2", "--model_tag=busy"]
    first = one_process(base_dir, *flags)
    read_until(first, "saved checkpoint")
    os.kill(first.pid, signal.SIGSTOP)  # holds the lock but writes nothing while the others try
    try:
        before = tree(ckpt_dir(base_dir, "busy"))
        for extra in ([], ["--overwrite"], ["--resume"]):  # a process, then in this one (a start costs seconds)
            if extra:
                done = in_process(base_dir, [*flags, *extra])
                rc, out = done.returncode, done.stdout + done.stderr
            else:
                rc, out = finish(one_process(base_dir, *flags))
            assert rc != 0, out
            assert f"is in use by another run (PID {first.pid} on host {socket.gethostname()}" in out, out
            assert "--overwrite never moves a run in progress" in out and "Traceback" not in out
            assert tree(ckpt_dir(base_dir, "busy")) == before
        assert not [d for d in os.listdir(os.path.dirname(ckpt_dir(base_dir, "busy"))) if ".replaced-" in d]
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    done = in_process(base_dir, [*flags, "--resume", "--max_hours=0.0000001"])
    assert done.returncode == 0 and "resumed busy from step" in done.stdout, done.stdout[-3000:] + done.stderr


# slow: a torchrun start (~20 s of CPU) for what two CI tests check: the lock's refusal (the live-tag test above) and
# a failure before training on rank 0 stopping every rank (test_a_write_that_fails_on_rank_0_stops_every_rank_...)
@pytest.mark.slow
def test_a_locked_tag_refuses_both_ranks_under_torchrun(base_dir, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    held = lifecycle.RunLock(ckpt_dir(base_dir, "held2"), active=True)
    held.claim()
    try:
        rc, out = finish(base_train(base_dir, *FLAGS, "--num_iterations=2", "--model_tag=held2"))
    finally:
        held.release()
    assert rc != 0 and f"in use by another run (PID {os.getpid()} on host" in out, out[-3000:]
    assert "locking the run directory failed on rank 0" in out  # rank 1 was told, and left too
    assert os.listdir(ckpt_dir(base_dir, "held2")) == ["run.lock"]


def test_the_lock_is_one_holders_and_free_after_release(tmp_path):
    first, second = (lifecycle.RunLock(str(tmp_path / "run"), active=True) for _ in range(2))
    second.hold_existing()  # nothing there yet: nothing to hold, nothing written
    assert not os.path.exists(tmp_path / "run")
    first.claim()
    first.claim()  # again, as after the checks: still ours
    with pytest.raises(lifecycle.RunLockError, match=f"PID {os.getpid()} on host"):
        second.hold_existing()
    first.release()
    with open(tmp_path / "run" / "run.lock", "w") as f:
        f.write("a longer signature a previous run left behind, which the next one replaces whole\n" * 3)
    second.claim()
    lines = open(tmp_path / "run" / "run.lock").read().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"PID {os.getpid()} on host")
    second.release()


# ---------------------------------------------------------------------------------------------------- signals in
# evaluation
def test_sigterm_during_an_evaluation_saves_the_step_and_exits_at_once(base_dir, monkeypatch, capfd):
    # in this process, the signal sent from inside step 4's evaluation (after its first batch): where it lands is
    # certain, where one from outside needs evaluations long enough to hit (the slow test below); the signal from
    # torchrun is test_sigterm_to_torchrun_saves_exits_and_resumes_bit_identically
    from nanochat import trainer
    real, calls, sent = trainer.validation_bpb, [], []

    def signalled_in_the_second(*args, stop, **kwargs):
        calls.append(1)

        def stop_after_signal():
            if len(calls) == 2 and not sent:
                sent.append(time.time())
                os.kill(os.getpid(), signal.SIGTERM)
            return stop()
        return real(*args, stop=stop_after_signal, **kwargs)
    monkeypatch.setattr(trainer, "validation_bpb", signalled_in_the_second)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    # 8 batches per evaluation: the signal lands with 7 to go. capfd: the handler writes to stderr's descriptor
    rc = exit_code(base_train_main, *FLAGS, "--num_iterations=50", "--eval_every=4", "--eval_tokens=512",
                   "--save_every=0", "--save_every_minutes=0", "--model_tag=evalterm1")
    took, out = time.time() - sent[0], "".join(capfd.readouterr())
    assert len(calls) == 2, out[-3000:]
    assert "SIGTERM received: finishing the current batch, then saving" in out, out[-3000:]
    assert "during the evaluation at step 4: saving and stopping" in out, out[-3000:]
    assert out.count("stopped at step 4 by SIGTERM received") == 1
    assert out.count("validation bpb per step") == 1  # step 0's; step 4's was abandoned
    assert checkpoints(base_dir, "evalterm1") == [4]
    assert rc == 143
    assert took < 30, took  # inside torchrun's 30 s before it SIGKILLs; in practice one batch and a save


# a minute under torchrun; the in-process test above checks the evaluation's stop, and
# test_sigterm_to_torchrun_saves_exits_and_resumes_bit_identically the signal from torchrun
@pytest.mark.slow
def test_sigterm_to_torchrun_during_an_evaluation_saves_the_step_and_exits_at_once(base_dir):
    # every evaluation takes ~10 s here (300,000 tokens), a training step milliseconds
    flags = [*FLAGS, "--num_iterations=50", "--eval_every=4", "--eval_tokens=300000", "--save_every=0",
             "--save_every_minutes=0", "--model_tag=evalterm2"]
    proc = base_train(base_dir, *flags)
    assert "validation bpb per step" in read_until(proc, "step 00004/")  # step 0's evaluation, in full
    time.sleep(2)  # into the evaluation at step 4
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc)
    took = time.time() - t0
    assert "SIGTERM received: finishing the current batch, then saving" in out, out[-3000:]
    assert "during the evaluation at step 4: saving and stopping" in out, out[-3000:]
    assert out.count("stopped at step 4 by SIGTERM received") == 2  # every rank exited on its own
    assert "validation bpb per step" not in out  # step 4's evaluation was abandoned
    assert checkpoints(base_dir, "evalterm2") == [4]
    assert took < 30, took  # inside torchrun's 30 s before it SIGKILLs; in practice one batch and a save


# ---------------------------------------------------------------------------------------------------- early stopping
def test_early_stop_counts_evaluations_without_a_new_best_and_resumes_its_count():
    early = lifecycle.EarlyStop(2)
    for step, bpb in ((0, 3.0), (1, 2.5), (2, 2.5), (3, 2.6)):  # a tie is no improvement
        assert early.reason() is None
        early.record(step, bpb)
    assert early.reason() == ("early stop (--early_stop=2): the validation bpb has not beaten 2.5000 (step 1) for 2 "
                              "evaluations in a row")
    resumed = lifecycle.EarlyStop(3, early.state())
    resumed.record(3, 2.6)  # the resume step's evaluation again: counted once already
    assert resumed.reason() is None and resumed.stale == 2
    resumed.record(4, 2.4)
    assert resumed.stale == 0 and resumed.best == (4, 2.4)
    off = lifecycle.EarlyStop(0, best_recorded=(7, 1.0))  # from an older checkpoint's recorded bpb
    off.record(8, 1.5)
    assert off.stale == 1 and off.reason() is None


# Imports the entry point named in argv[1] and prints PYTORCH_ALLOC_CONF at the moment torch is first imported: the
# CUDA allocator reads its setting once, at CUDA's first initialisation, which can come any time after that import.
# It exits there, as nothing after that import can change what it saw (and torch's import would cost seconds each).
AT_TORCH_IMPORT = """
import importlib, importlib.abc, os, sys
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            print(os.environ.get("PYTORCH_ALLOC_CONF"), flush=True)
            os._exit(0)
sys.meta_path.insert(0, Spy())
importlib.import_module(sys.argv[1])
print("torch never imported")
"""
GPU_ENTRY_POINTS = ("scripts.base_train", "scripts.base_loss", "scripts.base_eval", "scripts.serve", "scripts.compare",
                    "scripts.base_sample", "scripts.halt_train", "dev.gpu_check")


def allocator_setting_at_torch_import(module, **env):
    import subprocess
    import sys

    from tests.support.helpers import ROOT
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    proc = subprocess.run([sys.executable, "-c", AT_TORCH_IMPORT, module], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_every_gpu_entry_point_sets_the_allocator_before_it_imports_torch():
    for module in GPU_ENTRY_POINTS:
        assert allocator_setting_at_torch_import(module) == "expandable_segments:True", module


def test_an_entry_point_leaves_the_users_allocator_setting_alone():
    assert allocator_setting_at_torch_import("scripts.base_train", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128") \
        == "None"
    assert allocator_setting_at_torch_import("scripts.base_train", PYTORCH_ALLOC_CONF="max_split_size_mb:64") \
        == "max_split_size_mb:64"


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path, target_exists):
    victim = tmp_path / "victim.txt"
    if target_exists:
        victim.write_text("precious\n")
    (tmp_path / "run").mkdir()
    os.symlink(victim, tmp_path / "run" / "run.lock")
    lock = lifecycle.RunLock(str(tmp_path / "run"), active=True)
    for stage in (lock.hold_existing, lock.claim):
        with pytest.raises(lifecycle.RunLockError, match="run.lock is a symbolic link .*: remove it"):
            stage()
    assert (victim.read_text() == "precious\n") if target_exists else not victim.exists()
