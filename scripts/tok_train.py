"""Train the BPE tokenizer on the train shards (or make the byte-level one); saved to $NANOCHAT_BASE_DIR/tokenizer.

    python -m scripts.tok_train --vocab_size 8192 --max_chars 20_000_000
    python -m scripts.tok_train --byte_level     # 256 byte tokens + the special tokens, no merges, no training
                                                 # (the one for the synthetic hops corpus: docs/reasoning.md)

A tokenizer that checkpoints were trained with (their meta.json records its fingerprint) is not replaced unless
--force is given: retrained, the same token ids would mean other text.
"""

import os
import sys
import time

from nanochat import checkpoint as ckpt
from nanochat.cli import ArgumentParser, DefaultsHelp, ExitCode
from nanochat.common import progress_bar
from nanochat.data.dataset import DatasetError, iter_documents, parquets_for_split, row_group_sizes
from nanochat.data.tokenizer import (
    MIN_VOCAB_SIZE,
    RustBPETokenizer,
    TokenizerError,
    TokenizerNotFound,
    check_vocab_size,
    tokenizer_dir,
)
from nanochat.files import checkpoints_root
from nanochat.model.gpt import GPTConfig

# The model's default vocabulary is the tokenizer's: a default model fits a default tokenizer.
DEFAULT_VOCAB_SIZE = GPTConfig.vocab_size


def capped_documents(max_chars, doc_cap, stats):
    """Train documents cut to doc_cap chars (one huge file must not dominate the merges), max_chars in all."""
    num_docs = sum(sum(row_group_sizes(path)) for path in parquets_for_split("train"))
    with progress_bar(total=num_docs, desc="documents fed", unit="doc") as bar:
        for doc in iter_documents("train"):
            doc = doc[:doc_cap]
            stats["chars"] += len(doc)
            stats["bytes"] += len(doc.encode())
            bar.update(1)
            yield doc
            if stats["chars"] >= max_chars:
                return


def dependent_model_tags(fingerprint):
    """Model tags with a checkpoint whose meta.json records this tokenizer fingerprint."""
    root = checkpoints_root()
    tags = set()
    for tag in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for step in ckpt.list_steps(tag):
            try:
                meta = ckpt.read_meta(tag, step, checked=False)  # a malformed one still says whose tokenizer
            except (OSError, ValueError):  # a torn meta.json is --resume's to report; it records nothing here
                continue
            if isinstance(meta, dict) and meta.get("tokenizer_fingerprint") == fingerprint:
                tags.add(tag)
    return sorted(tags)


def check_replaceable(force):
    """Refuse, before any training, to replace a tokenizer that checkpoints depend on."""
    try:
        fingerprint = RustBPETokenizer.from_directory(tokenizer_dir()).fingerprint()
    except TokenizerNotFound:
        return
    except TokenizerError as e:
        print(f"note: replacing an unreadable tokenizer ({e})")
        return
    tags = dependent_model_tags(fingerprint)
    if tags and not force:
        raise TokenizerError(f"{tokenizer_dir()} is the tokenizer of the checkpoints of {', '.join(tags)}: a new one "
                             "would change what their token ids mean. Pass --force to replace it anyway, or set "
                             "NANOCHAT_BASE_DIR to another directory")
    if tags:
        print(f"warning: --force: replacing the tokenizer (fingerprint {fingerprint}) of {', '.join(tags)}")


def check_args(args):
    if args.byte_level and args.vocab_size is not None:
        raise TokenizerError(f"--byte_level has a fixed vocabulary ({MIN_VOCAB_SIZE} tokens); drop --vocab_size")
    if args.byte_level:
        return
    args.vocab_size = DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size
    check_vocab_size(args.vocab_size)
    for name in ("max_chars", "doc_cap"):
        if getattr(args, name) < 1:
            raise TokenizerError(f"--{name} must be at least 1, got {getattr(args, name)}")


def train(args, stats):
    tokenizer = RustBPETokenizer.train_from_iterator(capped_documents(args.max_chars, args.doc_cap, stats),
                                                     args.vocab_size)
    if tokenizer.get_vocab_size() < args.vocab_size:
        raise TokenizerError(f"the training text ({stats['chars']:,} chars) yields only "
                             f"{tokenizer.get_vocab_size():,} tokens, not the {args.vocab_size:,} asked for; "
                             "train on more text (--max_chars, --doc_cap, more shards) or ask for a smaller "
                             "--vocab_size. Nothing was saved")
    return tokenizer


def main(argv=None):
    parser = ArgumentParser(description="Train a byte-level BPE tokenizer", formatter_class=DefaultsHelp)
    parser.add_argument("--vocab_size", type=int, default=None,
                        help=f"including the special tokens (default: {DEFAULT_VOCAB_SIZE:,})")
    parser.add_argument("--byte_level", action="store_true",
                        help="no merges: the 256 bytes are the tokens (sequences ~4x longer than BPE's); recommended "
                             "for --synthetic=hops corpora, where every answer must be one token of its own and BPE "
                             "merges would fuse it with its neighbours")
    parser.add_argument("--max_chars", type=int, default=10_000_000_000, help="train on at most this many chars")
    parser.add_argument("--doc_cap", type=int, default=10_000, help="use at most this many chars of each document")
    parser.add_argument("--force", action="store_true", help="replace a tokenizer that checkpoints depend on")
    args = parser.parse_args(argv)
    stats = {"chars": 0, "bytes": 0}
    try:
        check_args(args)
        if not args.byte_level:
            parquets_for_split("train")  # no shards: say which command makes them before any work starts
        check_replaceable(args.force)
        t0 = time.time()
        tokenizer = RustBPETokenizer.byte_level() if args.byte_level else train(args, stats)
    except (DatasetError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.FAILED
    seconds = time.time() - t0
    tokenizer.save(tokenizer_dir())
    if not args.byte_level:
        print(f"trained on {stats['chars']:,} chars ({stats['bytes'] / 1e6:.1f} MB) in {seconds:.2f}s: "
              f"{stats['bytes'] / 1e6 / seconds:.2f} MB/s")
    print(f"vocab size {tokenizer.get_vocab_size():,}, fingerprint {tokenizer.fingerprint()}, "
          f"saved to {tokenizer_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
