"""
How long does torch.compile take as the recursion deepens? The first training step (compile + run) and the second
(compiled, no recompile expected), for models with more and more block applications, compiled two ways:

    whole     torch.compile(model): the whole unrolled recursion is one graph (what base_train did before)
    regional  model.compile_layer_visits(): one compiled layer visit serves every layer, loop and step (base_train now)

    python -m dev.bench_compile                          # 8, 24 and 48 block applications, both modes, CPU inductor
    python -m dev.bench_compile --modes regional --applications 8,48

Block applications per forward = n_sup_train x n_layer x (n_loops + 1); here n_layer=2, n_loops=1 and n_sup_train
grows. Each measurement runs in a fresh process with an empty inductor cache, so no compiled code is shared between
them (inductor's on-disk cache would otherwise serve the regional graphs, identical at every depth, in ~3 s).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from nanochat.model.gpt import GPT, GPTConfig


def measure(mode, applications, threads):
    """(seconds of the first training step, of the second, graphs compiled) in this process."""
    from torch._dynamo.utils import counters
    torch.set_num_threads(threads)
    n_layer, n_loops = 2, 1
    config = GPTConfig(sequence_len=64, vocab_size=512, n_layer=n_layer, n_head=2, n_kv_head=2, n_embd=64,
                       n_loops=n_loops, n_sup_train=applications // (n_layer * (n_loops + 1)))
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    idx = torch.randint(0, config.vocab_size, (4, config.sequence_len))
    if mode == "whole":
        compiled = torch.compile(model, dynamic=False)
        step = lambda: compiled(idx, idx)[0].backward()
    else:
        model.compile_layer_visits()
        step = lambda: model.forward_backward(idx, idx)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times[0], times[1], counters["stats"]["unique_graphs"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--applications", default="8,24,48", help="block applications per forward (multiples of 4)")
    parser.add_argument("--modes", default="whole,regional")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "APPLICATIONS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.threads)))
        return
    print(f"torch {torch.__version__}, CPU inductor, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    print(f"{'mode':<9} {'applications':>12} {'first step s':>12} {'second step s':>13} {'graphs':>6}")
    for mode in args.modes.split(","):
        for n in map(int, args.applications.split(",")):
            with tempfile.TemporaryDirectory() as cache:
                out = subprocess.run([sys.executable, "-m", "dev.bench_compile", "--threads", str(args.threads),
                                      "--child", mode, str(n)], capture_output=True, text=True, check=True,
                                     env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}).stdout
            first, second, graphs = json.loads(out.strip().splitlines()[-1])
            print(f"{mode:<9} {n:>12} {first:>12.1f} {second:>13.2f} {graphs:>6}", flush=True)


if __name__ == "__main__":
    main()
