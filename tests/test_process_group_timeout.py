"""No rank waits alone past the process-group timeout: rank 0's checkpoint I/O and backup, longer than the timeout,
with the other rank waiting (2 Gloo processes as torchrun starts them, a 5 s timeout, one launch with a hard
timeout)."""

import os
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from nanochat import common
from tests.support import forked, processes
from tests.support.helpers import ROOT, TINY, ckpt_dir

TIMEOUT_S = "5"  # the process group's; rank 0's slow steps take 1.5x as long
HANG = 240  # seconds: far above what the run takes here, so only a hang reaches it
GROUP_GAVE_UP = ("Connection closed", "Timed out", "timed out", "Timeout")


@pytest.fixture(scope="module")
def launch(base_dir, tmp_path_factory):
    """(exit code, output, backup bucket) of one 2-rank launch of tests/support/rank0_wait_worker.py: its slow steps,
    then a base_train run whose backup drains slowly."""
    bucket = tmp_path_factory.mktemp("rank0_wait") / "bucket"
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
           "NANOCHAT_PROCESS_GROUP_TIMEOUT_S": TIMEOUT_S}
    # 2 ranks as torchrun starts them, forked from the torch-preloaded server (nanochat is not preloaded: the
    # ranks read the timeout from their environment at import, as a fresh start does)
    cmd = [sys.executable, os.path.join("tests", "support", "rank0_wait_worker.py"), str(bucket), *TINY,
           "--eval_every=0", "--num_iterations=2", "--save_every=2", "--model_tag=slowbackup",
           f"--backup_dir={bucket}"]
    done = processes.finish(forked.Ranks(cmd, cwd=ROOT, env=env), HANG)
    return done.returncode, done.stdout + done.stderr, bucket


def test_every_rank0_wait_is_far_below_the_process_group_timeout(launch):
    assert common.RANK0_POLL_S <= common.PROCESS_GROUP_TIMEOUT.total_seconds() / 10
    out = launch[1]
    for rank in (0, 1):  # the environment's timeout, as the launched ranks read it
        assert f"rank {rank}: process group timeout 5.0 s, rank 0's longest wait 0.5 s" in out, out[-3000:]


def test_compute_init_gives_the_process_group_its_timeout(monkeypatch):
    given = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: given.update(kwargs))
    monkeypatch.setattr(dist, "barrier", lambda: None)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    common.compute_init("cpu")
    assert given["timeout"] == common.PROCESS_GROUP_TIMEOUT and given["backend"] == "gloo"
    assert common.PROCESS_GROUP_TIMEOUT == timedelta(seconds=float(os.environ.get(
        "NANOCHAT_PROCESS_GROUP_TIMEOUT_S") or 600))


def test_slow_work_saves_and_restores_on_rank0_keep_the_other_rank_waiting(launch):
    rc, out, _ = launch
    assert rc == 0, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: slow work done" in out
        assert f"rank {rank}: the work failed on rank 0: ValueError: injected" in out
        assert f"rank {rank}: saved steps [1]" in out and f"rank {rank}: resumed from step 1" in out
        assert f"rank {rank}: 20 collectives during the write: True; saved steps [2]" in out
        assert f"rank {rank}: saving step 3 (writing rank_{rank}.pt) failed on rank 1: ValueError: injected; " \
               f"saved steps [2]" in out
    assert not any(word in out for word in GROUP_GAVE_UP), out[-3000:]


def test_a_slow_backup_at_the_end_of_a_run_ends_both_ranks_cleanly(base_dir, launch):
    rc, out, bucket = launch
    assert rc == 0, out[-3000:]
    assert "rank 0: exited cleanly" in out and "rank 1: exited cleanly" in out
    assert not any(word in out for word in GROUP_GAVE_UP), out[-3000:]
    assert sorted(os.listdir(bucket / "slowbackup" / "step_000002")) == sorted(
        os.listdir(ckpt_dir(base_dir, "slowbackup", 2)))
