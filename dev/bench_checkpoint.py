"""
Blocked time per checkpoint save: how long the step loop waits in one save, written synchronously
(--async_checkpoint=0: the files, fsync and rename included) and in the background (the snapshot to CPU memory only),
on the depth-12 model on CPU after one optimizer step, into a temporary directory.

    python -m dev.bench_checkpoint                                     # depth 12, width 768, vocab 65536, 3 saves each
    python -m dev.bench_checkpoint --depth 4 --n_embd 256 --saves 5
    NANOCHAT_BASE_DIR=/tmp/bench torchrun --standalone --nproc_per_node=2 -m dev.bench_checkpoint   # every rank saves
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from dev.bench_args import add_model_flags, build_config
from nanochat import checkpoint as ckpt
from nanochat.checkpoint.writer import CheckpointWriter
from nanochat.common import compute_cleanup, compute_init, print0
from nanochat.files import gigabytes
from nanochat.model.gpt import GPT
from nanochat.train.optim import setup_optimizers


def build(args):
    """The model and its optimizers with state: one step on random gradients (Muon's momentum, AdamW's moments)."""
    torch.manual_seed(0)
    model = GPT(build_config(args))
    model.init_weights()
    optimizers = setup_optimizers(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for opt in optimizers:
        opt.step()
    return model, optimizers


def timed_saves(writer, model, optimizers, saves, tag, rank):
    """(seconds blocked in save(), seconds until the checkpoint is in place) per save."""
    blocked, done = [], []
    for step in range(1, saves + 1):
        t0 = time.perf_counter()
        writer.save(tag, step, model, optimizers, {"model_config": model.config.to_dict()}, {"loaders": []}, rank)
        blocked.append(time.perf_counter() - t0)
        writer.wait()  # a run's saves are minutes apart: each write is done before the next save
        done.append(time.perf_counter() - t0)
        if rank == 0:  # every rank's write is in place once wait() returns: the failure agreement is collective
            shutil.rmtree(ckpt.step_dir(tag, step))  # only one on the disk at a time
    return blocked, done


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser, depth=12, n_embd=768, n_head=6, vocab=65536)
    parser.add_argument("--saves", type=int, default=3, help="saves timed per mode")
    args = parser.parse_args()
    torchrun = "RANK" in os.environ
    if torchrun and not os.environ.get("NANOCHAT_BASE_DIR"):
        parser.error("under torchrun, set NANOCHAT_BASE_DIR to a directory every rank shares")
    model, optimizers = build(args)  # before the group: one process's optimizer state on each rank (an upper bound)
    rank = compute_init("cpu")[1] if torchrun else 0
    print0(f"depth {args.depth}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, a checkpoint "
          f"~{gigabytes(ckpt.checkpoint_bytes(model))}, torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as base:
        os.environ.setdefault("NANOCHAT_BASE_DIR", base)
        for name, background in (("synchronous", False), ("background", True)):
            with CheckpointWriter(background) as writer:
                blocked, done = timed_saves(writer, model, optimizers, args.saves, name, rank)
            print0(f"{name:>11}: blocked {', '.join(f'{t:.2f}' for t in blocked)} s (median "
                  f"{statistics.median(blocked):.2f} s); checkpoint in place after median "
                  f"{statistics.median(done):.2f} s")
    if torchrun:
        compute_cleanup(together=True)


if __name__ == "__main__":
    main()
