"""Train the BPE tokenizer on the train shards; saved to $NANOCHAT_BASE_DIR/tokenizer.

    python -m scripts.tok_train --vocab_size 8192 --max_chars 20_000_000
"""

import sys
import time

from nanochat.cli import ArgumentParser
from nanochat.dataset import DatasetError, iter_documents, parquets_for_split
from nanochat.tokenizer import RustBPETokenizer, tokenizer_dir


def capped_documents(max_chars, doc_cap, stats):
    """Train documents cut to doc_cap chars (one huge file must not dominate the merges), max_chars in all."""
    for doc in iter_documents("train"):
        doc = doc[:doc_cap]
        stats["chars"] += len(doc)
        stats["bytes"] += len(doc.encode())
        yield doc
        if stats["chars"] >= max_chars:
            return


def main(argv=None):
    parser = ArgumentParser(description="Train a byte-level BPE tokenizer")
    parser.add_argument("--vocab_size", type=int, default=65536, help="including the special tokens")
    parser.add_argument("--max_chars", type=int, default=10_000_000_000, help="train on at most this many chars")
    parser.add_argument("--doc_cap", type=int, default=10_000, help="use at most this many chars of each document")
    args = parser.parse_args(argv)
    try:
        parquets_for_split("train")  # no shards: say which command makes them before any work starts
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stats = {"chars": 0, "bytes": 0}
    t0 = time.time()
    tokenizer = RustBPETokenizer.train_from_iterator(capped_documents(args.max_chars, args.doc_cap, stats),
                                                     args.vocab_size)
    seconds = time.time() - t0
    tokenizer.save(tokenizer_dir())
    print(f"trained on {stats['chars']:,} chars ({stats['bytes'] / 1e6:.1f} MB) in {seconds:.2f}s: "
          f"{stats['bytes'] / 1e6 / seconds:.2f} MB/s")
    print(f"vocab size {tokenizer.get_vocab_size():,}, saved to {tokenizer_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
