"""
How long does torch.compile take as the recursion deepens? The first training step (compile + run) and the second
(compiled, no recompile expected), for models with more and more block applications, compiled two ways:

    whole     torch.compile(model): the whole unrolled recursion is one graph (what base_train did before)
    regional  compile_regions(model, "layer"): one compiled layer visit serves every layer, loop and step (base_train)

    python -m dev.bench_compile                          # 8, 24 and 48 block applications, both modes, CPU inductor
    python -m dev.bench_compile --modes regional --applications 8,48
    python -m dev.bench_compile --scopes layer,model     # a plain GPT's step in each --compile_scope, alternating

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
from nanochat.train.compile import compile_regions


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
        compile_regions(model, "layer")
        step = lambda: model.forward_backward(idx, idx)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times[0], times[1], counters["stats"]["unique_graphs"]


def measure_scopes(scopes, threads, steps=9):
    """{scope: (seconds of its first training step, median forward+backward wall seconds, median CPU seconds)} of a
    plain GPT (depth 4, width 256, 8 x 256 tokens, vocab 8,192: bench_train_step's), its head in one chunk, one copy
    compiled in each scope, their steps alternating in one process so that a change of load hits all alike."""
    import statistics
    torch.set_num_threads(threads)
    config = GPTConfig(sequence_len=256, vocab_size=8192, n_layer=4, n_head=2, n_kv_head=2, n_embd=256, n_loops=0,
                       n_sup_train=1)
    idx = torch.randint(0, config.vocab_size, (8, config.sequence_len), generator=torch.Generator().manual_seed(0))
    models, first, times = {}, {}, {scope: [] for scope in scopes}
    for scope in scopes:
        torch.manual_seed(0)
        models[scope] = GPT(config)
        models[scope].init_weights()
        models[scope].head_chunks = 1
        compile_regions(models[scope], scope)
    for step in range(steps + 1):
        for scope in scopes[::1 if step % 2 else -1]:
            t0, c0 = time.perf_counter(), time.process_time()
            models[scope].forward_backward(idx, idx, diagnostics=False)
            models[scope].zero_grad(set_to_none=True)
            if step:
                times[scope].append((time.perf_counter() - t0, time.process_time() - c0))
            else:
                first[scope] = time.perf_counter() - t0
    return {scope: (first[scope], statistics.median(t for t, _ in times[scope]),
                    statistics.median(c for _, c in times[scope])) for scope in scopes}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--applications", default="8,24,48", help="block applications per forward (multiples of 4)")
    parser.add_argument("--modes", default="whole,regional")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scopes", default="", help="time a plain GPT's step in these compile scopes instead")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "APPLICATIONS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child[0].startswith("scopes:"):
            print(json.dumps(measure_scopes(args.child[0][7:].split(","), args.threads)))
        else:
            print(json.dumps(measure(args.child[0], int(args.child[1]), args.threads)))
        return
    if args.scopes:
        print(f"torch {torch.__version__}, CPU inductor, {args.threads} thread(s), load average "
              f"{os.getloadavg()[0]:.2f}; plain GPT depth 4, width 256, 8 x 256 tokens, vocab 8,192, one head chunk")
        with tempfile.TemporaryDirectory() as cache:
            out = subprocess.run([sys.executable, "-m", "dev.bench_compile", "--threads", str(args.threads),
                                  "--child", f"scopes:{args.scopes}", "0"], capture_output=True, text=True,
                                 check=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}).stdout
        for scope, (first, wall, cpu) in json.loads(out.strip().splitlines()[-1]).items():
            print(f"scope {scope:<6} first step {first:6.1f} s, forward+backward median {wall:.3f} s wall, "
                  f"{cpu:.3f} s CPU", flush=True)
        print(f"load average now {os.getloadavg()[0]:.2f}")
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
