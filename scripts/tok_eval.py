"""Compression of the trained tokenizer (bytes per token, higher is better) on train and val text,
side by side with GPT-2 and GPT-4 when tiktoken can load them (it downloads them once, then reads its cache).

    python -m scripts.tok_eval
    python -m scripts.tok_eval --references=none     # offline: ours alone, nothing fetched
"""

import socket
import sys

import tiktoken

from nanochat.cli import ArgumentParser, DefaultsHelp, ExitCode
from nanochat.data.dataset import DatasetError, iter_documents
from nanochat.data.tokenizer import TokenizerError, get_tokenizer

REFERENCES = {"gpt2": "gpt2", "gpt4": "cl100k_base"}


def sample_text(split, max_chars):
    docs, total = [], 0
    for doc in iter_documents(split):
        if total >= max_chars:
            break
        docs.append(doc)
        total += len(doc)
    return docs


def reference_encodings(labels):
    """tiktoken fetches a missing encoding with no timeout; bound it so an offline machine answers in seconds."""
    found = {}
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5)
    try:
        for label, name in ((label, REFERENCES[label]) for label in labels):
            try:
                found[label] = tiktoken.get_encoding(name)
            except Exception as e:
                print(f"note: {label} ({name}) is not available offline, skipped ({type(e).__name__})")
    finally:
        socket.setdefaulttimeout(previous)
    return found


def main(argv=None):
    parser = ArgumentParser(description="Tokenizer compression on train and val text", formatter_class=DefaultsHelp)
    parser.add_argument("--max_chars", type=int, default=5_000_000, help="chars of each split to encode")
    parser.add_argument("--references", default="gpt2,gpt4",
                        help="tokenizers to compare with, from gpt2,gpt4; none: ours alone (no download is tried)")
    args = parser.parse_args(argv)
    labels = [] if args.references == "none" else args.references.split(",")
    unknown = sorted(set(labels) - set(REFERENCES))
    if unknown:
        parser.error(f"--references={args.references}: unknown {', '.join(unknown)}; use gpt2, gpt4 or none")
    try:
        tokenizer = get_tokenizer()
        samples = {split: sample_text(split, args.max_chars) for split in ("train", "val")}
    except (DatasetError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.FAILED
    encoders = {f"ours ({tokenizer.get_vocab_size()})": tokenizer.encode}
    for label, enc in reference_encodings(labels).items():
        encoders[f"{label} ({enc.n_vocab})"] = enc.encode_ordinary_batch
    print(f"{'split':<8}{'bytes':>14}" + "".join(f"{name:>20}" for name in encoders) + "   (bytes per token)")
    for split, docs in samples.items():
        num_bytes = sum(len(doc.encode()) for doc in docs)
        ratios = [num_bytes / max(1, sum(map(len, encode(docs)))) for encode in encoders.values()]
        print(f"{split:<8}{num_bytes:>14,}" + "".join(f"{ratio:>20.3f}" for ratio in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
