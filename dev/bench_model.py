"""
Does the recursion cost what its arithmetic costs? Times one training step (forward + backward + optimizer_step) of the
plain baseline and of TRM configs, and compares each time ratio with the ratio of train/flops.estimate_flops.

    python -m dev.bench_model                       # CPU-sized defaults
    python -m dev.bench_model --depth 2 --n_embd 128 --steps 3 --no-memory
    python -m dev.bench_model --threads 1           # a shared or busy machine: see --threads

ratio = (t_TRM / t_plain) / (flops_TRM / flops_plain): 1.0 means the recursion costs exactly its FLOPs; target <= 1.15.
Then the peak memory of one training step for the same configs, default vs activation_checkpointing vs
detach_between_steps.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop chatter on stderr; set before torch loads
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import nanochat.train.optim
from dev.bench_args import add_model_flags, build_config
from nanochat.model.gpt import GPT
from nanochat.train.flops import estimate_flops
from nanochat.train.optim import setup_optimizers

# (name, n_loops, T_recursion, n_sup_train); the first is the plain GPT everything is compared with
CONFIGS = [
    ("plain", 0, 1, 1),
    ("loops1-sup2", 1, 1, 2),
    ("loops2-sup2", 2, 1, 2),
    ("loops1-sup4", 1, 1, 4),
    ("loops1-T2-sup2", 1, 2, 2),
]


def build(args, n_loops, T_recursion, n_sup, **flags):
    config = build_config(args, sequence_len=args.seq_len, n_loops=n_loops, T_recursion=T_recursion,
                          n_sup_train=n_sup, **flags)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    optimizers = setup_optimizers(model)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g) for _ in range(2)]
    return model, optimizers, batch


def optimizer_step(optimizers, optim=nanochat.train.optim, ddp=False):
    """base_train's update at --grad_clip=1.0: reduce_gradients, the squared norm summed over ranks, clipped_step.
    optim: the nanochat.train.optim module of the checkout being timed."""
    sq_grad_norm = optim.reduce_gradients(optimizers)
    if ddp:
        dist.all_reduce(sq_grad_norm)
    optim.clipped_step(optimizers, sq_grad_norm.sqrt().item(), 1.0)


def train_step(model, optimizers, batch):
    """One training step; returns (seconds in forward + backward, seconds in optimizer_step)."""
    t0 = time.perf_counter()
    model.forward_backward(*batch)  # as base_train runs it: step-by-step backward under detach_between_steps
    t1 = time.perf_counter()
    optimizer_step(optimizers)
    model.zero_grad(set_to_none=True)
    return t1 - t0, time.perf_counter() - t1


def peak_step_memory(model, optimizers, batch):
    """Peak bytes of live tensors during one training step, above what was live when it started (weights and
    optimizer state, which a warm-up step has already created).

    On CPU, tracemalloc does not see torch's allocations and RSS high-water marks mix in the allocator's caching,
    fragmentation and the libraries' own memory. The profiler's memory events are emitted by torch's CPU allocator
    itself, one per tensor allocation (+bytes) and free (-bytes): their running sum in time order is the live tensor
    memory, and its maximum is the step's peak (activations saved for backward, gradients, temporaries). The raw
    kineto events are read because prof.events() folds the allocations made inside an op into that op.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(model, optimizers, batch)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per config (median reported)")
    # on a busy machine use fewer threads than free cores: an intra-op thread that loses its core stalls every op
    # (seen on a shared 2-core box: 1.8-5 s per plain step with 2 threads, 0.4 s with 1)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--configs", default="", help="comma-separated names from CONFIGS (default: all)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = [c for c in CONFIGS if not args.configs or c[0] in args.configs.split(",") or c[0] == "plain"]

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f} | "
          f"depth {args.depth} n_embd {args.n_embd} n_head {args.n_head} seq {args.seq_len} batch {args.batch} "
          f"vocab {args.vocab}")
    runs = {name: build(args, *shape) for name, *shape in configs}
    for name in runs:
        for _ in range(args.warmup):
            train_step(*runs[name])
    # round-robin: a change in background load hits every config alike instead of whichever ran at the time
    times = {name: [] for name in runs}  # (forward + backward, optimizer) per timed step
    for _ in range(args.steps):
        for name, run in runs.items():
            times[name].append(train_step(*run))

    def median(name, part=None):
        return statistics.median(sum(t) if part is None else t[part] for t in times[name])

    # ratio: the whole step, as training sees it. ratio_fb: forward + backward only. The optimizer's cost does not
    # depend on the recursion (Muon's Newton-Schulz is per matrix, not per token), so at few tokens per step it
    # inflates the plain step's time and pushes ratio below ratio_fb; ratio_fb is the recursion's own cost per FLOP.
    tokens = args.batch * args.seq_len
    plain_f = estimate_flops(runs["plain"][0])
    print(f"\n{'config':<16} {'n_loops':>7} {'T_rec':>5} {'n_sup':>5} {'GFLOP/step':>10} {'s/step':>7} {'fwd+bwd':>7} "
          f"{'optim':>6} {'min':>7} {'max':>7} {'GFLOP/s':>7} {'F/F_plain':>9} {'ratio':>6} {'ratio_fb':>8}")
    for (name, n_loops, T, n_sup) in configs:
        t, t_fb, t_opt, f = median(name), median(name, 0), median(name, 1), estimate_flops(runs[name][0])
        steps = [sum(x) for x in times[name]]
        gflop = f * tokens / 1e9
        print(f"{name:<16} {n_loops:>7} {T:>5} {n_sup:>5} {gflop:>10.1f} {t:>7.3f} {t_fb:>7.3f} {t_opt:>6.3f} "
              f"{min(steps):>7.3f} {max(steps):>7.3f} {gflop / t:>7.1f} {f / plain_f:>9.2f} "
              f"{(t / median('plain')) / (f / plain_f):>6.2f} {(t_fb / median('plain', 0)) / (f / plain_f):>8.2f}")
    del runs

    if args.no_memory:
        return
    print("\npeak tensor memory of one training step above weights + optimizer state, MiB")
    print(f"{'config':<16} {'default':>8} {'ckpt':>8} {'detach':>8}")
    variants = [{}, dict(activation_checkpointing=True), dict(detach_between_steps=True)]
    for (name, *shape) in configs:
        peaks = []
        for flags in variants:
            run = build(args, *shape, **flags)
            train_step(*run)  # creates the optimizer state, so the profiled step sees only the step's own memory
            peaks.append(peak_step_memory(*run) / 2 ** 20)
        print(f"{name:<16} " + " ".join(f"{p:>8.1f}" for p in peaks))


if __name__ == "__main__":
    main()
