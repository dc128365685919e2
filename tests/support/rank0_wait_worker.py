"""
Rank 0 working alone for longer than the process-group timeout while the other rank waits. Launched by
tests/test_process_group_timeout.py with a short NANOCHAT_PROCESS_GROUP_TIMEOUT_S as

    torchrun --standalone --nproc_per_node=2 tests/support/rank0_wait_worker.py <backup dir> [base_train flags...]

First the timeouts this process read, then `steps`: a slow piece of work, a failing one, a checkpoint whose weights
write slowly and a slow restore from a backup, a background save whose slow write runs beside the training's
collectives and one that fails on rank 1, each printing one line per rank; then, in the same process group (one
launch: a start costs more than the checks), a base_train run whose backup drains slowly at the end.
"""

import os
import shutil
import sys
import time

import torch.distributed

from nanochat.checkpoint import manager as ckpt
from nanochat.checkpoint import resume
from nanochat.checkpoint import writer as checkpoint_writer
from nanochat.checkpoint.backup import Backup
from nanochat.checkpoint.manager import build_model
from nanochat.checkpoint.writer import CheckpointWriter
from nanochat.collectives import RankFailure, raise_if_any_rank_failed, run_on_rank0
from nanochat.common import PROCESS_GROUP_TIMEOUT, RANK0_POLL_S, compute_init
from nanochat.model.gpt import GPTConfig

# 1.5 times the timeout: a collective waiting this long fails, with seconds to spare for the ranks' skew
SLOW_S = 1.5 * PROCESS_GROUP_TIMEOUT.total_seconds()


def slowly(function):
    def slow(*args, **kwargs):
        time.sleep(SLOW_S)
        return function(*args, **kwargs)
    return slow


def fail():
    raise ValueError("injected")


def move_to_backup(model_tag, step, backup_url):
    """As on a new machine: the checkpoint only in the backup."""
    Backup.location(backup_url, model_tag).upload(step)
    shutil.rmtree(ckpt.model_dir(model_tag))


def steps(backup_url):
    rank = compute_init("cpu")[1]
    print(f"rank {rank}: process group timeout {PROCESS_GROUP_TIMEOUT.total_seconds()} s, rank 0's longest wait "
          f"{RANK0_POLL_S} s", flush=True)
    assert run_on_rank0(slowly(lambda: None), rank) is None
    print(f"rank {rank}: slow work done", flush=True)
    try:
        raise_if_any_rank_failed(run_on_rank0(fail, rank), "the work")
    except RankFailure as e:
        print(f"rank {rank}: {e}", flush=True)
    config = GPTConfig(sequence_len=8, vocab_size=32, n_layer=1, n_head=1, n_kv_head=1, n_embd=8)
    model = build_model(config.to_dict(), "cpu")
    real_write = checkpoint_writer._write
    checkpoint_writer._write = lambda path, data: (slowly(real_write) if path.endswith(ckpt.WEIGHTS)
                                                   else real_write)(path, data)
    checkpoint_writer.save_checkpoint("slow", 1, model, [], {"model_config": model.config.to_dict()}, {"loaders": []},
                                      rank)
    checkpoint_writer._write = real_write
    print(f"rank {rank}: saved steps {ckpt.list_steps('slow')}", flush=True)
    torch.distributed.barrier()  # every rank has listed the save before rank 0 moves it to the backup
    run_on_rank0(lambda: move_to_backup("slow", 1, backup_url), rank)
    Backup.restore = slowly(Backup.restore)
    step = resume.load_resume_point("slow", "latest", rank, backup_url).step
    print(f"rank {rank}: resumed from step {step}", flush=True)
    background_saves(model, rank)


def background_saves(model, rank):
    """Saves in the writer's thread: the default group keeps working while rank 0 writes slowly, and a failed write
    on rank 1 reaches both ranks at wait()."""
    meta, real_write = {"model_config": model.config.to_dict()}, checkpoint_writer._write
    checkpoint_writer._write = lambda path, data: (slowly(real_write) if path.endswith(ckpt.WEIGHTS) else real_write)(
        path, data)
    with CheckpointWriter(background=True) as writer:
        writer.save("bg", 2, model, [], meta, {"loaders": []}, rank)
        for _ in range(20):  # the training's collectives, while the write is in flight
            torch.distributed.all_reduce(torch.ones(1))
        in_flight = not ckpt.list_steps("bg")
        writer.wait()
    print(f"rank {rank}: 20 collectives during the write: {in_flight}; saved steps {ckpt.list_steps('bg')}",
          flush=True)
    checkpoint_writer._write = lambda path, data: fail() if path.endswith("rank_1.pt") else real_write(path, data)
    with CheckpointWriter(background=True) as writer:
        writer.save("bg", 3, model, [], meta, {"loaders": []}, rank)
        try:
            writer.wait()
        except ckpt.CheckpointError as e:
            print(f"rank {rank}: {str(e).split('. ')[0]}; saved steps {ckpt.list_steps('bg')}", flush=True)
    checkpoint_writer._write = real_write


def base_train(argv):
    from scripts import base_train
    Backup.close = slowly(Backup.close)
    base_train.main(argv)  # in the process group steps() started (compute_init joins an existing one), then ends it
    print(f"rank {os.environ['RANK']}: exited cleanly", flush=True)


if __name__ == "__main__":
    steps(sys.argv[1])
    base_train(sys.argv[2:])
