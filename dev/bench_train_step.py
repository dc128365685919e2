"""
One CPU training step (forward + backward + optimizer step) of our model against karpathy/nanochat's GPT on the same
config, and of TRM configs against our plain model. Every timed round runs one step of each model in turn (in
alternating order), so a change in background load hits all of them alike; medians are reported.

    git clone https://github.com/karpathy/nanochat /tmp/nanochat      # HEAD (92d63d4 when last measured)
    python -m dev.bench_train_step --nanochat_dir /tmp/nanochat
    python -m dev.bench_train_step --nanochat_dir /tmp/nanochat --steps 3 --configs plain,loops1-sup2

nanochat's GPT runs on CPU as is (SDPA attention, float32 when not on CUDA), every layer full-context (window "L")
like ours. HEAD's optimizer is one MuonAdamW whose AdamW and Muon updates are torch.compile'd (2025 versions: fused
torch AdamW and a Muon with compiled Newton-Schulz); the bench clips with torch.nn.utils.clip_grad_norm_ at 1.0 for
both (HEAD's base_train does not clip: its optimizer column is a little high). Ours runs base_train's step:
forward_backward, then reduce_gradients and clipped_step at 1.0.

Targets (issue 13): our plain step <= 1.0x nanochat's, and each TRM config's step-time ratio over plain within 1.10x
of its FLOP ratio (train/flops.estimate_flops). Our plain step and nanochat's do the same FLOPs. Times are wall and CPU
seconds (this process's, which a machine busy with other work disturbs less than wall time).
"""

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time

import torch

from dev.bench_args import add_model_flags, build_config
from dev.bench_model import build, optimizer_step
from nanochat.train.flops import estimate_flops

# (name, n_loops, T_recursion, n_sup_train); plain is our GPT in nanochat's shape, the others are compared with it
CONFIGS = [
    ("plain", 0, 1, 1),
    ("loops1-sup2", 1, 1, 2),
    ("loops2-sup4", 2, 1, 4),
    ("loops1-T2-sup2", 1, 2, 2),
]


@contextlib.contextmanager
def other_nanochat(path):
    """Yields an import function for the modules of the package `nanochat` in path, usable beside ours."""
    # both packages are named nanochat: ours leaves sys.modules while theirs imports, then comes back (theirs lives on
    # in the objects made inside the with block, which hold their modules)
    def take_out():
        return {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "nanochat"}

    path = os.path.abspath(path)
    ours = take_out()
    sys.path.insert(0, path)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(path)
        take_out()
        sys.modules.update(ours)


def build_nanochat(nanochat_dir, args):
    """nanochat's GPT at our plain model's shape with its own optimizers: HEAD's one MuonAdamW (setup_optimizer), 2025
    versions' list (setup_optimizers); every layer full-context (window "L"), as ours, for the same attention FLOPs."""
    with other_nanochat(nanochat_dir) as load:
        gpt = load("nanochat.gpt")
        windows = {"window_pattern": "L"} if "window_pattern" in gpt.GPTConfig.__dataclass_fields__ else {}
        config = build_config(args, gpt.GPTConfig, sequence_len=args.seq_len, **windows)
        torch.manual_seed(0)
        model = gpt.GPT(config)
        model.init_weights()
        if hasattr(model, "setup_optimizer"):
            return model, [model.setup_optimizer()]
        return model, list(model.setup_optimizers())


def timed(fn):
    """(wall, CPU) seconds of fn(). CPU: this process's, which a busy machine disturbs less than wall time."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def our_step(model, optimizers, batch):
    """One training step as base_train runs it; returns the (wall, CPU) seconds of forward + backward and optimizer."""
    fb = timed(lambda: model.forward_backward(*batch))
    opt = timed(lambda: optimizer_step(optimizers))
    model.zero_grad(set_to_none=True)
    return fb, opt


def nanochat_step(model, optimizers, batch):
    """One training step as nanochat's base_train runs it, timed like our_step."""
    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()

    fb = timed(lambda: model(*batch).backward())
    opt = timed(update)
    model.zero_grad(set_to_none=True)
    return fb, opt


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanochat_dir", required=True, help="a checkout of karpathy/nanochat (see above)")
    add_model_flags(parser)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (nanochat compiles Newton-Schulz)")
    parser.add_argument("--steps", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--configs", default="", help="comma-separated names from CONFIGS (plain always runs)")
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.nanochat_dir, "nanochat", "gpt.py")):
        parser.error(f"--nanochat_dir {args.nanochat_dir}: no nanochat/gpt.py there; clone karpathy/nanochat first")
    torch.set_num_threads(args.threads)
    configs = [c for c in CONFIGS if not args.configs or c[0] in args.configs.split(",") or c[0] == "plain"]

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.2f} | "
          f"depth {args.depth} n_embd {args.n_embd} n_head {args.n_head} seq {args.seq_len} batch {args.batch} "
          f"vocab {args.vocab}, fp32")
    runs = {name: (our_step, *build(args, *shape)) for name, *shape in configs}
    batch = runs["plain"][3]
    nanochat_model, nanochat_opts = build_nanochat(args.nanochat_dir, args)
    runs["nanochat"] = (nanochat_step, nanochat_model, nanochat_opts, batch)
    times = {name: [] for name in runs}  # per timed round: ((wall, CPU) forward + backward, (wall, CPU) optimizer)
    for round_ in range(args.warmup + args.steps):
        for name in list(runs)[::1 if round_ % 2 else -1]:  # alternate the order: no model always follows another
            step, *run = runs[name]
            t = step(*run)
            if round_ >= args.warmup:
                times[name].append(t)

    def median(name, part="step", clock=0):  # part: "fb", "optim" or "step" (both); clock 0: wall, 1: CPU
        return statistics.median({"fb": fb[clock], "optim": opt[clock], "step": fb[clock] + opt[clock]}[part]
                                 for fb, opt in times[name])

    def per_flop(name, part="step", clock=0):  # time ratio over plain / FLOP ratio over plain
        return median(name, part, clock) / median("plain", part, clock) / (flops[name] / flops["plain"])

    tokens = args.batch * args.seq_len
    flops = {name: run[1].estimate_flops() if name == "nanochat" else estimate_flops(run[1])  # HEAD counts its own
             for name, run in runs.items()}
    print(f"\n{'':<16} {'':>10} {'wall s':-^22} {'CPU s':-^22} {'':>9} {'(t/t_plain)/(F/F_plain)':-^23}")
    print(f"{'model':<16} {'GFLOP/step':>10}" + f" {'step':>6} {'fw+bw':>7} {'optim':>7}" * 2 +
          f" {'F/F_plain':>9} {'wall':>7} {'CPU':>7} {'fw+bw':>7}")
    for name in runs:
        print(f"{name:<16} {flops[name] * tokens / 1e9:>10.1f}" +
              "".join(f" {median(name, 'step', c):>6.3f} {median(name, 'fb', c):>7.3f} "
                      f"{median(name, 'optim', c):>7.3f}" for c in (0, 1)) +
              f" {flops[name] / flops['plain']:>9.2f} {per_flop(name):>7.2f} {per_flop(name, clock=1):>7.2f} "
              f"{per_flop(name, 'fb', 1):>7.2f}")
    print("(fw+bw: forward + backward alone, CPU time; the optimizer's cost does not grow with the recursion, so it "
          "lowers the whole step's ratios)")
    for clock, label in [(0, "wall"), (1, "CPU")]:
        ratio = {part: median("plain", part, clock) / median("nanochat", part, clock)
                 for part in ("step", "fb", "optim")}
        print(f"plain / nanochat, {label} time: step {ratio['step']:.2f} (target <= 1.0), "
              f"forward+backward {ratio['fb']:.2f}, optimizer {ratio['optim']:.2f}")
    print(f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
