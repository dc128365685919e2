"""
The model flags the dev/bench_*.py scripts share, and the GPTConfig they describe:

    add_model_flags(parser)              # --depth 4 --n_embd 256 --n_head 2 --vocab 8192 unless a bench gives its own
    config = build_config(args, sequence_len=128, n_loops=2)   # what the bench sets itself wins over the flags
"""

from nanochat.model.gpt import GPTConfig

DEFAULTS = dict(depth=4, n_embd=256, n_head=2, vocab=8192)  # CPU-sized: a step in well under a second


def add_model_flags(parser, vocab_help=None, **defaults):
    """--depth, --n_embd, --n_head and --vocab (also spelled --vocab_size, as some benches had it) on parser, with
    DEFAULTS updated by defaults (n_head=None: the bench derives the heads itself)."""
    defaults = {**DEFAULTS, **defaults}
    parser.add_argument("--depth", type=int, default=defaults["depth"])
    parser.add_argument("--n_embd", type=int, default=defaults["n_embd"])
    parser.add_argument("--n_head", type=int, default=defaults["n_head"])
    parser.add_argument("--vocab", "--vocab_size", dest="vocab", type=int, default=defaults["vocab"], help=vocab_help)


def build_config(args, config_class=GPTConfig, **fields):
    """config_class (ours, or another checkout's GPTConfig) from the model flags: n_layer = --depth, n_kv_head =
    --n_head (no GQA), vocab_size = --vocab; fields, the bench's own choices, are added and win."""
    flags = dict(vocab_size=args.vocab, n_layer=args.depth, n_head=args.n_head, n_kv_head=args.n_head,
                 n_embd=args.n_embd)
    return config_class(**{**flags, **fields})
