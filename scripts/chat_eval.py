"""
Chat evaluation by supervision step, offline: each question answered greedily with 1, 2, ..., N supervision steps,
scored by exact match (nanochat/eval/chat_eval.py).

    python -m scripts.chat_eval --model_tag=cpu_d4_sft                 # the built tasks (arithmetic, hops), test split
    python -m scripts.chat_eval --model_tag=d12_sft --n_sup=8          # past the trained steps too
    python -m scripts.chat_eval --model_tag=d12_sft --data=qa.jsonl    # your conversations, each ending with the answer
    python -m scripts.chat_eval --server=http://127.0.0.1:8000         # the same through lm-eval's chat backend

Writes chat_eval_step<N>.json, .md (the table and example replies) and .png (accuracy by step) into the run's
directory, or --out. With --server the questions go through lm-eval's local-chat-completions to a running
`python -m scripts.serve` (its /v1/chat/completions, n_sup sent per step; the key from --api_key or
NANOCHAT_API_KEY), scored the same way, into chat_eval_step<N>_server.*.
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split
import json
import os
import sys

import torch

from nanochat import checkpoint as ckpt
from nanochat.cli import DefaultsHelp, Exit, ExitCode, OneLineErrors, missing_package
from nanochat.common import autocast_for, autodetect_device_type, default_dtype, device_available
from nanochat.data.chat import ChatDataError
from nanochat.eval.chat_eval import (
    evaluate_chat,
    evaluate_chat_server,
    format_chat_eval,
    format_examples,
    items_from,
    plot_chat_eval,
)
from nanochat.files import atomic_write_bytes, exit_on_write_error, save_figure


def parse_args(argv=None):
    p = OneLineErrors(prog="python -m scripts.chat_eval", allow_abbrev=False, formatter_class=DefaultsHelp)
    ckpt.checkpoint_flags(p, "the chat model to evaluate (chat_sft's tag)")
    p.add_argument("--data", default="builtin",
                   help="builtin (the built tasks' test split), or a .jsonl / hf:NAME of conversations each ending "
                        "with the assistant's reference answer")
    p.add_argument("--n_sup", type=int, default=None,
                   help="evaluate steps 1..n_sup (default: n_sup_inference); more than were trained is allowed")
    p.add_argument("--limit", type=int, default=None, help="questions per task (default: all)")
    p.add_argument("--max_tokens", type=int, default=16, help="reply tokens before a reply counts as not ended")
    p.add_argument("--batch_size", type=int, default=32, help="questions answered at once")
    p.add_argument("--device_type", default="", help="cuda | cpu | mps (default: autodetect: cuda, mps, cpu)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="autocast dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    p.add_argument("--out", default=None, help="directory for the results (default: the run's directory)")
    p.add_argument("--server", default=None,
                   help="a running server's base URL: ask it through lm-eval's chat backend (the eval and serve "
                        "extras) instead of loading the checkpoint here (default: none)")
    p.add_argument("--api_key", default=None, help="the server's key (default: $NANOCHAT_API_KEY)")
    args = p.parse_args(argv)
    for name in ("n_sup", "limit", "max_tokens", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be >= 1")
    args.device_type = args.device_type or autodetect_device_type()
    if not device_available(args.device_type):
        p.error(f"--device_type={args.device_type} is not available on this machine")
    return args


def main(argv=None):
    try:
        return evaluate(argv)
    except Exit as e:
        sys.stderr.write(f"{e}\n")
        sys.exit(e.exit_code)


def evaluate(argv):
    args = parse_args(argv)
    try:
        items = items_from(args.data, args.limit)
    except ChatDataError as e:
        raise Exit(f"chat_eval: {e}", code=ExitCode.USAGE)
    if args.server:
        result, tag, step, trained, suffix = through_server(args, items)
    else:
        result, tag, step, trained = in_process(args, items)
        suffix = ""
    title = f"chat exact match by supervision step: {tag} step {step}" + (" (served, lm-eval)" if suffix else "")
    table = format_chat_eval(result, trained)
    report = f"# {title}\n\ndata: {args.data}; trained with {trained} supervision steps\n\n{table}\n\n" \
             f"Example replies:\n\n{format_examples(result)}\n"
    print(report)
    out = args.out or (ckpt.model_dir(tag) if os.path.isdir(ckpt.model_dir(tag)) or not suffix else ".")
    base = os.path.join(out, f"chat_eval_step{step:06d}{suffix}")
    with exit_on_write_error("chat_eval"):
        os.makedirs(out, exist_ok=True)
        atomic_write_bytes(base + ".json", json.dumps(result, indent=2).encode())
        atomic_write_bytes(base + ".md", report.encode())
        try:
            figure = plot_chat_eval(result, title, trained)
        except ImportError as e:
            figure = None
            print(f"no plot: {missing_package(e, 'the plot')}")
        if figure is not None:
            save_figure(figure, base + ".png", dpi=120)
    print(f"results: {base}.json, .md" + (", .png" if figure is not None else ""))
    return result


def in_process(args, items):
    """(result, tag, step, trained steps) of the checkpoint loaded here."""
    try:
        overrides = {"n_sup_inference": args.n_sup} if args.n_sup else {}
        model, tokenizer, meta, tag, step = ckpt.open_checkpoint(args.model_tag, args.step,
                                                                 torch.device(args.device_type), **overrides)
    except ckpt.CheckpointError as e:
        raise Exit(f"chat_eval: {e}", code=ExitCode.USAGE)
    n_sup, trained = model.config.n_sup_inference, model.config.n_sup_train
    dtype = args.dtype or default_dtype(args.device_type)
    result = evaluate_chat(model, tokenizer, items, n_sup, args.batch_size, args.max_tokens,
                           lambda: autocast_for(args.device_type, dtype))
    result.update(model_tag=tag, step=step, data=args.data, n_sup_train=trained, init_from=meta.get("init_from"))
    return result, tag, step, trained


def through_server(args, items):
    """(result, tag, step, trained steps, file suffix) of the model a running server serves, asked through lm-eval."""
    try:
        import httpx  # lazy: the serve extra's, for --server only
    except ImportError as e:
        raise Exit(f"chat_eval: {missing_package(e, '--server')}", code=ExitCode.USAGE)
    key = args.api_key or os.environ.get("NANOCHAT_API_KEY") or None
    try:
        # a keyed server tells the model and its limits only to the key's holder
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        health = httpx.get(f"{args.server.rstrip('/')}/health", headers=headers, timeout=30).json()
        tag, step = health["model_tag"], health["step"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise Exit(f"chat_eval: {args.server} does not answer as a nanochat server ({e}); start one with python -m "
                   f"scripts.serve", code=ExitCode.USAGE)
    n_sup = args.n_sup or health["n_sup_inference"]
    if not 1 <= n_sup <= health["n_sup_max"]:
        raise Exit(f"chat_eval: --n_sup={n_sup}: the server runs 1 to {health['n_sup_max']}", code=ExitCode.USAGE)
    try:
        result = evaluate_chat_server(args.server, tag, items, n_sup, args.max_tokens, key)
    except ImportError as e:
        raise Exit(f"chat_eval: {missing_package(e, '--server')}", code=ExitCode.USAGE)
    result.update(model_tag=tag, step=step, data=args.data, n_sup_train=health["n_sup_train"], server=args.server)
    return result, tag, step, health["n_sup_train"], "_server"


if __name__ == "__main__":
    main()
