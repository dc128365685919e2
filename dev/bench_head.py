"""
Time and peak memory of one supervision step's head in training: lm_head, softcap and cross-entropy, forward and
backward, under bf16 autocast on CPU. Each variant runs in a fresh process, so its peak resident memory (VmHWM,
reset after the warm-up that compiles) is its own.

    eager             the plain head + F.cross_entropy, as training ran before the chunked head
    compiled          the same, torch.compile'd whole (inductor, dynamic=False)
    chunked           ChunkedHeadLoss with the eager chunk (training without --compile), default chunks
    chunked-compiled  the same chunk compiled (inductor), default chunks
    one-chunk         the head as training runs it now without --compile: the final norm folded in, one chunk of
                      every row (the plan's, where memory allows)
    one-chunk-fused   the same, compiled as --compile compiles it (the fusable chunk: one region)

The default chunk is HEAD_CHUNK_ELEMENTS logits (4,096 rows at vocab 65,536); the one-chunk variants take y before
the final norm, the others norm(y).

Usage: OMP_NUM_THREADS=1 python dev/bench_head.py [--rows 2048] [--n-embd 768] [--vocab 65536] [--iters 3]
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import nanochat.model.supervision as supervision

VARIANTS = ("eager", "compiled", "chunked", "chunked-compiled", "one-chunk", "one-chunk-fused")


def plain_head_loss(h, weight, targets):
    logits = F.linear(h, weight).float()
    return F.cross_entropy(supervision.SOFTCAP * torch.tanh(logits / supervision.SOFTCAP), targets, ignore_index=-1)


def head_loss_fn(variant):
    if variant == "eager":
        return plain_head_loss
    if variant == "compiled":
        return torch.compile(plain_head_loss, dynamic=False)
    if variant.startswith("one-chunk"):
        chunk = functools.partial(supervision.normed_head_chunk_loss_and_grads, fusable=variant.endswith("fused"))
        chunk = torch.compile(chunk, dynamic=False) if variant.endswith("fused") else chunk
        return lambda y, weight, targets: supervision.ChunkedHeadLoss.apply(y, weight, targets, chunk, y.size(0))
    chunk = supervision.head_chunk_loss_and_grads
    chunk = torch.compile(chunk, dynamic=False) if variant == "chunked-compiled" else chunk
    return lambda h, weight, targets: supervision.ChunkedHeadLoss.apply(h, weight, targets, chunk)


def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(variant, rows, n_embd, vocab, iters):
    """Seconds per forward+backward (best of iters) and peak bytes above the resident memory before it."""
    torch.manual_seed(0)
    h = torch.randn(rows, n_embd, requires_grad=True)
    weight = (torch.randn(vocab, n_embd) / n_embd ** 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    loss_fn = head_loss_fn(variant)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(h, weight, targets)
        loss.backward()
        h.grad = weight.grad = None

    step()  # warm-up: compiles
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = status_kib("VmRSS")
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"variant": variant, "seconds": min(times), "peak_bytes": (status_kib("VmHWM") - before) * 1024}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048, help="B*T tokens of the micro-batch")
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--iters", type=int, default=3, help="timed forward+backward runs; the best is reported")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.rows, args.n_embd, args.vocab, args.iters)))
        return
    logits_bytes = 4 * args.rows * args.vocab
    print(f"head forward+backward, bf16 autocast, {args.rows} rows x n_embd {args.n_embd} x vocab {args.vocab} "
          f"(one float32 logits tensor: {logits_bytes / 2**20:.0f} MiB), torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    for variant in VARIANTS:
        child = [sys.executable, __file__, "--variant", variant] + sys.argv[1:]
        # a fixed mmap threshold: glibc returns every freed large block at once, so VmHWM sees each step's peak
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**16)}
        result = json.loads(subprocess.run(child, check=True, capture_output=True, text=True, env=env).stdout)
        print(f"{variant:>17}: {result['seconds']:7.3f} s   peak {result['peak_bytes'] / 2**20:7.0f} MiB "
              f"({result['peak_bytes'] / logits_bytes:.1f} x the logits)")


if __name__ == "__main__":
    main()
