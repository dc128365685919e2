"""base_train --sharding=fsdp end to end on 1 and 2 Gloo processes: sharded checkpoints that resume on another process
count as an uninterrupted run, a kill, SIGTERM and a budget stop, and one process reading a sharded checkpoint. The
2-process runs are 2 ranks forked as torchrun starts them; the 1-process ones run in this process, in a process group
of one (as torchrun --nproc_per_node=1 gives them), since a launch costs seconds of starting Python and torch."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.support import forked, processes
from tests.support.helpers import ROOT, TINY, ckpt_dir, finish, read_until
from tests.test_base_train import in_process

FLAGS = TINY + ["--eval_every=0", "--keep_last=0", "--save_every_minutes=0", "--sharding=fsdp", "--ema_decay=0.5",
                "--grad_clip=0.5"]


def base_train(base_dir, *flags):
    """base_train on 2 processes as torchrun starts them (forked from the torch-preloaded server), one accumulation
    step each: 2 data ranks."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": base_dir, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "scripts.base_train", *FLAGS, "--gradient_accumulation_steps=1", *flags]
    return forked.Ranks(cmd, cwd=ROOT, env=env, stderr=subprocess.STDOUT)


def completed(proc):
    rc, out = finish(proc, timeout=150)
    assert rc == 0, out[-4000:]
    return out


def one_process(base_dir, *flags):
    """base_train in this process as rank 0 of a Gloo process group of one, with 2 accumulation steps: the same 2
    data ranks. Its CompletedProcess (run_or_exit ends the group on every way out)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
            mp.setenv(name, value)
        try:
            return in_process(base_dir, [*FLAGS, "--gradient_accumulation_steps=2", *flags])
        finally:  # a run that raised past run_or_exit: the group must not outlive it into other tests
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def published(base_dir, tag, step, part="model"):
    from nanochat.checkpoint.manager import read_shards
    return read_shards(ckpt_dir(base_dir, tag, step), part)


def assert_same_weights(base_dir, tag_a, tag_b, step):
    for part in ("model", "train_model"):  # the EMA, and the weights training goes on from
        a, b = published(base_dir, tag_a, step, part), published(base_dir, tag_b, step, part)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=f"{part} {k}")


def wait_dead(pids, timeout=30):
    """Until every process in pids has exited (gone, or a zombie: its files closed and locks released)."""
    deadline = time.time() + timeout
    for pid in pids:
        while time.time() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except OSError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"process {pid} still alive {timeout}s after SIGKILL")


@pytest.fixture(scope="module")
def uninterrupted(base_dir):
    """The tag of a 6-step run on 1 process: what an interrupted run must end at, whatever its process counts."""
    done = one_process(base_dir, "--num_iterations=6", "--model_tag=fs_straight")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return "fs_straight"


def test_killed_on_two_processes_resumed_on_one_continues_as_the_uninterrupted_run(base_dir, uninterrupted):
    flags = ["--num_iterations=6", "--save_every=2"]
    proc = base_train(base_dir, *flags, "--model_tag=fs_killed")
    read_until(proc, "step 00005/", timeout=150)  # after step 4's checkpoint, before step 6's
    workers = [*proc.pids, *(pid for rank in proc.pids for pid in processes.descendants(rank))]
    processes.kill_all(proc)
    wait_dead(workers)  # the kernel frees rank 0's run lock as it dies; the resume below starts at once
    assert sorted(os.listdir(ckpt_dir(base_dir, "fs_killed"))).count("step_000004") == 1
    assert not os.path.exists(ckpt_dir(base_dir, "fs_killed", 6))
    done = one_process(base_dir, *flags, "--model_tag=fs_killed", "--resume")
    for _ in range(20):  # on a loaded machine a killed rank can hold the run's lock a moment after the wait above
        if "is in use by another run" not in done.stdout + done.stderr:
            break
        time.sleep(0.5)
        done = one_process(base_dir, *flags, "--model_tag=fs_killed", "--resume")
    assert done.returncode == 0 and "resumed fs_killed from step 4" in done.stdout, done.stdout[-3000:] + done.stderr
    assert_same_weights(base_dir, uninterrupted, "fs_killed", 6)


def test_sigterm_on_one_process_saves_and_two_processes_continue_as_the_uninterrupted_run(base_dir, uninterrupted,
                                                                                          monkeypatch):
    from nanochat import trainer
    real = trainer.Run.log_step

    def signalled_after_step_2(self, step, *args, **kwargs):
        real(self, step, *args, **kwargs)
        if step == 2:  # as torchrun forwards one: to this process, between steps
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(trainer.Run, "log_step", signalled_after_step_2)
    flags = ["--num_iterations=6"]
    done = one_process(base_dir, *flags, "--model_tag=fs_term")
    monkeypatch.undo()
    out = done.stdout + done.stderr
    assert done.returncode == 143 and "stopped at step" in out, out[-4000:]
    at = int(out.split("stopped at step ")[1].split()[0])  # the step whose flags the signal reached first
    assert 2 <= at < 6 and os.path.exists(os.path.join(ckpt_dir(base_dir, "fs_term", at), ".metadata"))
    out = completed(base_train(base_dir, *flags, "--model_tag=fs_term", "--resume"))
    assert f"resumed fs_term from step {at}" in out
    assert_same_weights(base_dir, uninterrupted, "fs_term", 6)


def test_budget_stop_saves_shards_that_one_process_loads_and_ddp_refuses_to_resume(base_dir):
    out = completed(base_train(base_dir, "--num_iterations=100000", "--max_hours=0.0005", "--model_tag=fs_budget"))
    stop = [line for line in out.splitlines() if line.startswith("budget spent (--max_hours=0.0005) at step")]
    assert len(stop) == 1, out[-3000:]
    at = int(stop[0].split("at step ")[1].split(":")[0])
    from nanochat.checkpoint import manager as ckpt
    os.environ["NANOCHAT_BASE_DIR"] = base_dir
    try:
        assert ckpt.list_steps("fs_budget") == [at]
        model, tokenizer, meta = ckpt.load_model("fs_budget", "latest")  # one process, no process group
    finally:
        del os.environ["NANOCHAT_BASE_DIR"]
    shards = published(base_dir, "fs_budget", at)
    assert all(torch.equal(model.state_dict()[k], shards[k]) for k in shards)
    assert not any(v.isnan().any() for v in shards.values())
    x = torch.tensor([tokenizer.encode("the cat sat")])
    assert torch.isfinite(model(x[:, :-1], x[:, 1:])[0])
    # the refusal is each rank's own check of the checkpoint's meta: one process (in this one) shows it
    refused = in_process(base_dir, [*FLAGS, "--gradient_accumulation_steps=2", "--num_iterations=100000",
                                    "--model_tag=fs_budget", "--resume", "--sharding=ddp"])
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0, out[-3000:]
    assert "sharding: checkpoint 'fsdp' vs this run 'ddp' (pass --sharding=fsdp)" in out, out[-3000:]
