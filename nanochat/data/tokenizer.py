"""Byte-level BPE: trained with rustbpe, encoded and decoded with tiktoken. With no merges (byte_level()) every
byte is its own token: a 265-token vocabulary whose sequences are ~4x longer than BPE's for the same text.

A str holding surrogates (not valid Unicode, so not UTF-8 encodable) is encoded as tiktoken does it: a lone
surrogate becomes U+FFFD and a high+low pair the character it stands for, and decode(encode(s)) returns that.
Every other str round-trips exactly.
"""

import base64
import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import tiktoken
import torch

from nanochat.files import fsync_dir, get_base_dir

SPECIAL_TOKENS = [
    "<|bos|>",  # begins every document
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # the assistant calling the python tool
    "<|output_start|>", "<|output_end|>",  # what the tool returned
]

# GPT-4's pattern, but numbers split in runs of at most 2 digits (nanochat's choice: fewer merges spent on numbers)
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
FILENAME = "tokenizer.json"
# the split pattern's lookahead (\s+(?!\S)) overflows the Rust regex engine's stack on a whitespace run of ~1M
# characters, and tiktoken and rustbpe panic; runs are cut into pieces this long, 10x below where it held in tests
WHITESPACE_RUN = 10_000
LONG_RUN = re.compile(r"\s{%d,}" % WHITESPACE_RUN)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte, then the special tokens
MAX_VOCAB_SIZE = 2 ** 20  # 4x the largest vocabularies in use (262k); beyond it a typo, not a tokenizer


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or trained; the message names the file or value and what to do."""


class TokenizerNotFound(TokenizerError, FileNotFoundError):
    """No tokenizer has been trained in this directory yet."""


def check_vocab_size(vocab_size):
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise TokenizerError(f"vocab_size must be between {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} "
                             f"special tokens) and {MAX_VOCAB_SIZE:,}, got {vocab_size}")


def segments(text):
    """text as consecutive pieces with no whitespace run longer than WHITESPACE_RUN (text itself when it has none,
    as nearly all text: then the split is the pattern's alone)."""
    if len(text) <= WHITESPACE_RUN or not LONG_RUN.search(text):
        return [text]
    pieces, start = [], 0
    for run in LONG_RUN.finditer(text):
        for cut in range(run.start() + WHITESPACE_RUN, run.end(), WHITESPACE_RUN):
            pieces.append(text[start:cut])
            start = cut
    return pieces + [text[start:]]


def train_bpe(text_iterator, vocab_size):
    """Learn merges with rustbpe, leaving room for the special tokens in vocab_size."""
    check_vocab_size(vocab_size)
    import rustbpe  # here, not at the top: only training needs it, and GPU images without it still load tokenizers
    bpe = rustbpe.Tokenizer()
    pieces = (piece for text in text_iterator for piece in segments(text))
    bpe.train_from_iterator(pieces, vocab_size - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
    return bpe


class RustBPETokenizer:
    """A tiktoken Encoding holding the learned merges plus nanochat's special tokens."""

    def __init__(self, pattern, mergeable_ranks):
        self.pattern = pattern
        self.mergeable_ranks = mergeable_ranks  # token bytes -> id, ids 0..n-1
        special_tokens = {name: len(mergeable_ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(name="rustbpe", pat_str=pattern, mergeable_ranks=mergeable_ranks,
                                     special_tokens=special_tokens)
        self.bos_token_id = self.encode_special("<|bos|>")

    @classmethod
    def from_rustbpe(cls, bpe):
        # the pattern is read back from the trainer, so encoding can only ever split text the way training did
        return cls(bpe.get_pattern(), {bytes(token): rank for token, rank in bpe.get_mergeable_ranks()})

    @classmethod
    def byte_level(cls):
        """The 256 bytes and the special tokens, no merges: nothing to learn, so no training text."""
        return cls(SPLIT_PATTERN, {bytes([b]): b for b in range(256)})

    @classmethod
    def train_from_iterator(cls, iterator, vocab_size):
        return cls.from_rustbpe(train_bpe(iterator, vocab_size))

    @classmethod
    def from_directory(cls, directory):
        path = os.path.join(directory, FILENAME)
        if not os.path.exists(path):
            raise TokenizerNotFound(f"no tokenizer at {path}; train one with `python -m scripts.tok_train`")
        try:
            with open(path, "rb") as f:
                saved = json.load(f)
            ranks = {base64.b64decode(token, validate=True): rank for rank, token in enumerate(saved["tokens"])}
            if len(ranks) != len(saved["tokens"]) or not all(bytes([b]) in ranks for b in range(256)):
                raise ValueError("its tokens repeat, or miss one of the 256 bytes")
            return cls(saved["pattern"], ranks)
        except (OSError, ValueError, KeyError, TypeError) as e:  # truncated, not JSON, wrong shape, bad base64
            raise TokenizerError(f"{path} is not a readable tokenizer ({type(e).__name__}: {e}); restore it, or "
                                 "train it again with `python -m scripts.tok_train` (checkpoints trained with the "
                                 "old one need the same tokens)") from e

    def save(self, directory):
        """Write into a fresh directory and swap it in: readers see the old tokenizer or the new one, never half."""
        tokens = sorted(self.mergeable_ranks, key=self.mergeable_ranks.get)
        # written by hand: tiktoken's dump needs blobfile, and its loader caches by path, which would serve a
        # retrained tokenizer's old merges
        saved = {"pattern": self.pattern, "tokens": [base64.b64encode(token).decode() for token in tokens]}
        directory = os.path.abspath(directory)
        tmp, old = f"{directory}.tmp{os.getpid()}", f"{directory}.old{os.getpid()}"
        os.makedirs(tmp)
        with open(os.path.join(tmp, FILENAME), "w") as f:
            json.dump(saved, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(directory):
            os.rename(directory, old)
        os.rename(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(os.path.dirname(directory))

    def fingerprint(self):
        """A short hash of the split pattern, merges and special tokens: equal iff two tokenizers give equal ids."""
        h = hashlib.sha256(self.pattern.encode())
        for token in sorted(self.mergeable_ranks, key=self.mergeable_ranks.get):
            h.update(len(token).to_bytes(2, "little") + token)
        h.update("\n".join(SPECIAL_TOKENS).encode())
        return h.hexdigest()[:16]

    def get_vocab_size(self):
        return self.enc.n_vocab

    def get_bos_token_id(self):
        return self.bos_token_id

    def encode_special(self, name):
        return self.enc.encode_single_token(name)

    def encode(self, text, prepend=None, num_threads=8):
        """str -> ids, or list of str -> list of ids. Special-token text in the input stays ordinary text."""
        if isinstance(prepend, str):
            prepend = self.encode_special(prepend)
        head = [] if prepend is None else [prepend]
        if isinstance(text, str):
            return head + self.encode_ordinary(text)
        if not any(len(t) > WHITESPACE_RUN and LONG_RUN.search(t) for t in text):
            return [head + ids for ids in self.enc.encode_ordinary_batch(text, num_threads=num_threads)]
        with ThreadPoolExecutor(num_threads) as pool:  # as tiktoken's batch does, each text cut by segments
            return [head + ids for ids in pool.map(self.encode_ordinary, text)]

    def encode_ordinary(self, text):
        return [token for piece in segments(text) for token in self.enc.encode_ordinary(piece)]

    def decode(self, ids):
        return self.enc.decode(ids)


def tokenizer_dir():
    return os.path.join(get_base_dir(), "tokenizer")


def get_tokenizer():
    return RustBPETokenizer.from_directory(tokenizer_dir())


def get_token_bytes(device="cpu", tokenizer=None):
    """UTF-8 byte length of every token id, 0 for special tokens so bits-per-byte counts only real text."""
    tokenizer = tokenizer or get_tokenizer()
    enc = tokenizer.enc
    lengths = [0 if enc.is_special_token(i) else len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]
    return torch.tensor(lengths, dtype=torch.int32, device=device)
