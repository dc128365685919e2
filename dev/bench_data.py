"""Data pipeline speed on this machine: tokenizer training on the built-in corpus, and loader tokens/s.

    python -m dev.bench_data [--vocab_size 8192] [--max_chars 50_000_000] [--B 8 --T 256]

Everything is built in a temporary directory; nothing under $NANOCHAT_BASE_DIR is touched.

Loader memory and cost as base_train uses the loaders, on the corpus and tokenizer under $NANOCHAT_BASE_DIR:

    python -m dev.bench_data --loaders 64 [--steps 20] [--B 4 --T 64]

builds the loaders of data ranks 0..63 of 64 (one per micro-step, as base_train does at accumulation 64), draws one
batch from each per step, and prints the process's resident memory after the first step and after the last
(VmRSS, VmHWM from /proc/self/status) and the time per batch.
"""

import argparse
import os
import tempfile
import time

import torch

from nanochat.data.dataloader import DataLoader
from nanochat.data.dataset import build_builtin
from nanochat.data.tokenizer import RustBPETokenizer, get_tokenizer
from scripts.tok_train import capped_documents


def resident_mb():
    """(VmRSS, VmHWM) of this process in MB."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM"))


def loader_memory(args):
    tokenizer = get_tokenizer()
    t0 = time.perf_counter()
    loaders = [DataLoader(tokenizer, args.B, args.T, "train", rank=r, world_size=args.loaders,
                          tokenizer_threads=args.tokenizer_threads) for r in range(args.loaders)]
    built = time.perf_counter()
    for loader in loaders:
        next(loader)
    first = time.perf_counter()
    rss, hwm = resident_mb()
    print(f"loaders {args.loaders}: after one batch each: VmRSS {rss:.1f} MB, VmHWM {hwm:.1f} MB; built in "
          f"{built - t0:.2f}s, first batches {(first - built) / args.loaders * 1e3:.3f} ms each", flush=True)
    for _ in range(args.steps - 1):
        for loader in loaders:
            next(loader)
    if args.steps > 1:
        rss, hwm = resident_mb()
        per_batch = (time.perf_counter() - first) / ((args.steps - 1) * args.loaders)
        print(f"loaders {args.loaders}: after {args.steps} steps: VmRSS {rss:.1f} MB, VmHWM {hwm:.1f} MB; "
              f"later batches {per_batch * 1e3:.3f} ms each (B={args.B} T={args.T})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--max_chars", type=int, default=50_000_000)
    parser.add_argument("--doc_cap", type=int, default=10_000)
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to run the loader")
    parser.add_argument("--tokenizer_threads", type=int, default=2)
    parser.add_argument("--loaders", type=int, help="measure this many data ranks' loaders instead (see above)")
    parser.add_argument("--steps", type=int, default=1, help="with --loaders: batches drawn from each loader")
    args = parser.parse_args()
    if args.loaders:
        return loader_memory(args)
    print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["NANOCHAT_DATA_DIR"] = os.path.join(tmp, "base_data")
        t0 = time.time()
        build_builtin()
        print(f"built-in corpus built in {time.time() - t0:.1f}s")

        stats = {"chars": 0, "bytes": 0}
        t0 = time.time()
        tokenizer = RustBPETokenizer.train_from_iterator(capped_documents(args.max_chars, args.doc_cap, stats),
                                                         args.vocab_size)
        seconds = time.time() - t0
        print(f"tokenizer: vocab {tokenizer.get_vocab_size():,} trained on {stats['bytes'] / 1e6:.1f} MB "
              f"(doc_cap {args.doc_cap:,}) in {seconds:.2f}s = {stats['bytes'] / 1e6 / seconds:.2f} MB/s")

        loader = DataLoader(tokenizer, args.B, args.T, "train", rank=0, world_size=1,
                            tokenizer_threads=args.tokenizer_threads)
        next(loader)  # first row group read outside the clock
        tokens, t0 = 0, time.time()
        while time.time() - t0 < args.seconds:
            inputs, _ = next(loader)
            tokens += inputs.numel()
        seconds = time.time() - t0
        print(f"loader: B={args.B} T={args.T}: {tokens / seconds:,.0f} tokens/s over {seconds:.1f}s "
              f"(state {loader.state_dict()})")


if __name__ == "__main__":
    main()
