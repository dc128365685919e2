"""
FSDP (--sharding=fsdp) against DDP (replicated weights, ZeRO-1 optimizers) on Gloo ranks: parameter all-gathers and
gradient reduce-scatters per micro-step (FSDP's collectives counted by wrapping torch.distributed's), seconds per
optimizer step, the peak resident memory and the tensor bytes held between steps. CPU only; the counts are what a GPU
run makes too.

    torchrun --standalone --nproc_per_node=2 -m dev.bench_fsdp                       # TRM defaults at width 256
    torchrun --standalone --nproc_per_node=2 -m dev.bench_fsdp --n_loops=0 --n_sup_train=1 --depth=8
"""

import argparse
import collections
import gc
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dev.bench_args import add_model_flags, build_config
from nanochat.model.gpt import GPT
from nanochat.train import sharding
from nanochat.train.optim import clipped_step, reduce_gradients, setup_optimizers

COUNTED = ("all_gather_single", "reduce_scatter_single", "all_to_all", "all_reduce")  # FSDP2's and ShardedMuon's


def counting(calls):
    """Wrap the collectives FSDP calls (torch.distributed.X at call time) to count calls and bytes."""
    for name in COUNTED:
        if not hasattr(dist, name):  # torch < 2.13 names them all_gather_into_tensor / reduce_scatter_tensor
            name = {"all_gather_single": "all_gather_into_tensor",
                    "reduce_scatter_single": "reduce_scatter_tensor"}[name]
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            values = list(args) + list(kwargs.values())
            tensors = [a for a in values if torch.is_tensor(a)] + [t for a in values if isinstance(a, list) for t in a]
            calls[_name] += 1  # bytes of the largest tensor: the gathered output, or the scattered input
            calls[_name + " MB"] += round(max((t.numel() * t.element_size() for t in tensors), default=0) / 1e6, 3)
            return _real(*args, **kwargs)
        setattr(dist, name, counted)


def build(config, fsdp):
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    if fsdp:
        sharding.shard_model(model, torch.device("cpu"))
    optimizers = setup_optimizers(model)
    return model, sharding.on_shards(optimizers) if fsdp else optimizers


def step(model, optimizers, idx):
    model.forward_backward(idx, idx)
    sq_norm = reduce_gradients(optimizers)
    dist.all_reduce(sq_norm)
    clipped_step(optimizers, sq_norm.sqrt().item(), 1.0)
    model.zero_grad(set_to_none=True)


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensor_bytes():
    """Bytes of the distinct storages of every tensor Python holds (weights, gradients, optimizer state, FSDP's
    buffers): what stays between steps. On CPU the resident size cannot show it (the allocator keeps freed pages)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and not isinstance(obj, DTensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main():
    p = argparse.ArgumentParser()
    add_model_flags(p, n_head=None)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--n_loops", type=int, default=None)
    p.add_argument("--n_sup_train", type=int, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--sharding", choices=["ddp", "fsdp"], default="fsdp")
    p.add_argument("--activation_checkpointing", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    overrides = {k: v for k, v in (("n_loops", args.n_loops), ("n_sup_train", args.n_sup_train)) if v is not None}
    args.n_head = args.n_head or max(1, args.n_embd // 128)  # heads of 128 wide unless --n_head says otherwise
    config = build_config(args, sequence_len=args.seq, activation_checkpointing=args.activation_checkpointing,
                          **overrides)
    base = rss()
    model, optimizers = build(config, args.sharding == "fsdp")
    idx = torch.randint(0, config.vocab_size, (args.batch, config.sequence_len))
    step(model, optimizers, idx)  # warm-up: first-call allocations and lazy FSDP init
    calls = collections.Counter()
    counting(calls)
    model.forward_backward(idx, idx)
    micro = dict(calls)
    calls.clear()
    sq_norm = reduce_gradients(optimizers)
    clipped_step(optimizers, sq_norm.sqrt().item(), 1.0)
    model.zero_grad(set_to_none=True)
    update = dict(calls)
    dist.barrier()
    t0 = time.time()
    for _ in range(args.steps):
        step(model, optimizers, idx)
    dt = (time.time() - t0) / args.steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # includes the whole model built first
    held = live_tensor_bytes()
    if rank == 0:
        c = config
        print(f"{args.sharding} on {dist.get_world_size()} Gloo ranks: depth {c.n_layer}, width {c.n_embd}, n_loops "
              f"{c.n_loops}, n_sup_train {c.n_sup_train}, T_recursion {c.T_recursion}, detach "
              f"{c.detach_between_steps}, checkpointing {c.activation_checkpointing}, batch {args.batch} x {args.seq}, "
              f"{model.num_params():,} parameters")
        print(f"  one micro-step (forward_backward): {micro}")
        print(f"  the update (reduce_gradients + clipped_step): {update}")
        print(f"  {dt * 1000:.0f} ms per optimizer step (mean of {args.steps}); peak RSS above the start "
              f"{peak / 1e6:.0f} MB (FSDP too builds the whole model first); tensors held between steps "
              f"{held / 1e6:.0f} MB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
