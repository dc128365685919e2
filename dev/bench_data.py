"""Data pipeline speed on this machine: tokenizer training on the built-in corpus, and loader tokens/s.

    python -m dev.bench_data [--vocab_size 8192] [--max_chars 50_000_000] [--B 8 --T 256]

Everything is built in a temporary directory; nothing under $NANOCHAT_BASE_DIR is touched.
"""

import argparse
import os
import tempfile
import time

import torch

from nanochat.dataloader import DataLoader
from nanochat.dataset import build_builtin
from nanochat.tokenizer import RustBPETokenizer
from scripts.tok_train import capped_documents


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--max_chars", type=int, default=50_000_000)
    parser.add_argument("--doc_cap", type=int, default=10_000)
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to run the loader")
    args = parser.parse_args()
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

        loader = DataLoader(tokenizer, args.B, args.T, "train", rank=0, world_size=1, tokenizer_threads=2)
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
