"""
Optimizer step time: base_train's update (reduce_gradients, the global norm, clipped_step) over the model's optimizers
(AdamW for the embedding and lm_head, Muon for the block matrices) on fixed random gradients. Under torchrun the same
step runs DistAdamW + DistMuon on Gloo.

    python -m dev.bench_optim                                          # depth 4, width 256, vocab 8192
    python -m dev.bench_optim --depth 12 --n_embd 768 --n_head 6 --steps 5
    torchrun --standalone --nproc_per_node=2 -m dev.bench_optim        # 2 Gloo processes

--baseline DIR also times another checkout's optimizer (e.g. main's, for "before"), alternating steps with ours so
that a change in background load hits both alike:

    git archive main | tar -x -C /tmp/trm-main    # (mkdir /tmp/trm-main first)
    python -m dev.bench_optim --baseline /tmp/trm-main
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from dev.bench_args import add_model_flags, build_config
from dev.bench_model import optimizer_step
from dev.bench_train_step import other_nanochat


def build(gpt_module, optim_module, args, seed):
    """The model's optimizers, with every parameter given a fixed random gradient (seed: one per rank)."""
    config = build_config(args, gpt_module.GPTConfig, n_loops=0, n_sup_train=1)
    torch.manual_seed(0)
    model = gpt_module.GPT(config)
    model.init_weights()
    # setup_optimizers lives in optim.py now; a baseline checkout from before has it on the model
    setup = getattr(optim_module, "setup_optimizers", None)
    optimizers = setup(model) if setup else model.setup_optimizers()
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    return optimizers


def timed_step(optim, optimizers, ddp):
    """(wall, CPU) seconds of one optimizer_step with optim's functions; under DDP the slowest rank's, as a step lasts
    until all are done.

    CPU seconds (this process's, all threads) are less disturbed by a busy machine than wall time."""
    if ddp:
        dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    optimizer_step(optimizers, optim, ddp)  # every step reuses the same gradients: only the time matters
    dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
    if ddp:
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--baseline", default="", help="another nanochat-TRM checkout whose optimizer to time too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)

    import nanochat.model.gpt
    import nanochat.train.optim
    runs = {"ours": (nanochat.train.optim, build(nanochat.model.gpt, nanochat.train.optim, args, rank))}
    if args.baseline:
        with other_nanochat(args.baseline) as load:  # setup_optimizers imports the optimizers: build in here
            new_layout = os.path.isdir(os.path.join(args.baseline, "nanochat", "train"))  # the move of 2026-11-28
            optim = load("nanochat.train.optim" if new_layout else "nanochat.optim")
            runs["baseline"] = (optim, build(load("nanochat.model.gpt" if new_layout else "nanochat.gpt"), optim, args,
                                             rank))
    times = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        for name, run in runs.items():
            dt = timed_step(*run, ddp)
            if step >= args.warmup:
                times[name].append(dt)

    if rank == 0:
        print(f"torch {torch.__version__}, {world} process(es) x {torch.get_num_threads()} thread(s), "
              f"load average {os.getloadavg()[0]:.2f} | depth {args.depth} n_embd {args.n_embd} vocab {args.vocab} | "
              f"{' + '.join(type(o).__name__ for o in runs['ours'][1])}")
        wall = {name: statistics.median(t[0] for t in ts) for name, ts in times.items()}
        cpu = {name: statistics.median(t[1] for t in ts) for name, ts in times.items()}
        for name, ts in times.items():
            source = args.baseline if name == "baseline" else os.path.dirname(os.path.dirname(nanochat.__file__))
            print(f"{name:<8} optimizer step: median {wall[name] * 1e3:7.1f} ms "
                  f"(min {min(t[0] for t in ts) * 1e3:7.1f}), CPU {cpu[name] * 1e3:7.1f} ms, over {args.steps} steps "
                  f"  ({source})")
        if args.baseline:
            print(f"ours / baseline: wall {wall['ours'] / wall['baseline']:.2f}, "
                  f"CPU {cpu['ours'] / cpu['baseline']:.2f}")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
