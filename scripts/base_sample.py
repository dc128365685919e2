"""
Sample completions from a base-model checkpoint.

python -m scripts.base_sample --model_tag d12 --step best --prompt "The capital of France is" --show_steps
python -m scripts.base_sample --prompts_file prompts.txt --temperature 0 --n_sup 2
python -m scripts.base_sample --halt kl:0.0005 --show_steps    # per-token adaptive halting, steps of each token

--show_steps prints, under each completion, the greedy continuation after every supervision step: the draft the
model would commit to if it stopped refining there (a forward with n_sup=s computes exactly the first s steps).
With --halt (RULE:THRESHOLD, rules kl, rms, head) each token refines until the rule halts it; --show_steps then also
prints how many supervision steps each generated token used.
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split
import sys

import torch

from nanochat.checkpoint import checkpoint_flags, open_checkpoint
from nanochat.cli import ArgumentParser, DefaultsHelp, ExitCode
from nanochat.common import autocast_for, autodetect_device_type, compute_init, default_dtype, device_available
from nanochat.model.engine import Engine, kv_cache_bytes_per_token
from nanochat.model.halting import Halting

DEFAULT_PROMPTS = ["The capital of France is", "The chemical symbol of gold is", "If yesterday was Friday, then"]


def parse_args(argv=None):
    parser = ArgumentParser(description="Print completions from a base-model checkpoint", formatter_class=DefaultsHelp)
    checkpoint_flags(parser)
    parser.add_argument("--prompt", action="append", default=[],
                        help=f"a prompt; repeat for several (default: {len(DEFAULT_PROMPTS)} built-in prompts)")
    parser.add_argument("--prompts_file", default=None,
                        help="a file of prompts, one per line (blank lines skipped) (default: none)")
    parser.add_argument("--max_tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=50, help="sample from the k likeliest tokens; 0 = all")
    parser.add_argument("--n_sup", type=int, default=None, help="supervision steps, 1..n_sup_inference (default: all)")
    parser.add_argument("--seed", type=int, default=42, help="sampling seed, for reproducible samples")
    parser.add_argument("--show_steps", action="store_true",
                        help="print the greedy draft after each supervision step (with --halt: each token's steps)")
    parser.add_argument("--halt", default=None,
                        help="per-token adaptive halting, RULE:THRESHOLD, e.g. kl:0.0005 (default: off)")
    parser.add_argument("--device_type", default=None, help="cuda | cpu | mps (default: autodetect: cuda, mps, cpu)")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max_tokens={args.max_tokens}: must be >= 1")
    if args.temperature < 0:
        parser.error(f"--temperature={args.temperature}: must be >= 0 (0 is greedy)")
    if args.top_k < 0:
        parser.error(f"--top_k={args.top_k}: must be >= 0 (0 = no restriction)")
    if args.halt is not None:
        try:
            args.halt = Halting.parse(args.halt)
        except ValueError as e:
            parser.error(f"--halt: {e}")
    args.device_type = args.device_type or autodetect_device_type()
    if not device_available(args.device_type):
        parser.error(f"--device_type={args.device_type} is not available on this machine")
    args.prompts = args.prompt + (read_prompts(parser, args.prompts_file) if args.prompts_file else [])
    args.prompts = args.prompts or DEFAULT_PROMPTS
    return args


def read_prompts(parser, path):
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"--prompts_file {path}: {e}")
    if not prompts:
        parser.error(f"--prompts_file {path} holds no prompts")
    return prompts


def rate(tokens, seconds):
    return f"{tokens} tokens in {seconds:.3f}s ({tokens / max(seconds, 1e-9):,.1f} tok/s)"


def main(argv=None):
    args = parse_args(argv)
    device = compute_init(args.device_type)[4]  # TF32 matmuls on CUDA, as in training
    dtype = default_dtype(args.device_type)
    try:
        model, tokenizer, meta, _, _ = open_checkpoint(args.model_tag, args.step, device)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    engine = Engine(model, tokenizer, autocast=lambda: autocast_for(args.device_type, dtype))  # bf16 on GPU
    config = model.config
    n_sup = config.n_sup_inference if args.n_sup is None else args.n_sup
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k or None, seed=args.seed)
    try:
        generated = engine.generate_batch([engine.encode_prompt(p) for p in args.prompts], n_sup=n_sup,
                                          halt=args.halt, **sampling)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    completions = [tokenizer.decode(ids) for ids in generated]
    stats = engine.stats
    print(f"model step {meta['step']}: n_layer={config.n_layer} n_embd={config.n_embd} n_loops={config.n_loops} "
          f"T_recursion={config.T_recursion} n_sup={n_sup} (of {config.n_sup_inference})")
    print(f"KV cache: {kv_cache_bytes_per_token(model, n_sup, getattr(torch, dtype)):,} bytes/token "
          f"({model.num_attention_slots(n_sup)} attention slots)")
    drafts = [engine.complete(args.prompts, n_sup=s, **{**sampling, "temperature": 0.0})
              for s in range(1, n_sup + 1)] if args.show_steps else []
    for i, (prompt, completion) in enumerate(zip(args.prompts, completions)):
        print(f"\n--- {prompt!r}\n{prompt}{completion}")
        for s, draft in enumerate(drafts, start=1):
            print(f"  step {s}/{n_sup} (greedy): {draft[i]!r}")
        if args.halt and args.show_steps:
            print("  steps per token: " + " ".join(f"{tokenizer.decode([t])!r}:{s}"
                                                   for t, s in zip(generated[i], stats["steps"][i])))
    if args.halt:
        used = [s for row in stats["steps"] for s in row]
        print(f"\nhalting {args.halt}: mean {sum(used) / max(1, len(used)):.2f} of {n_sup} supervision steps per "
              f"generated token")
    print(f"\nprefill: {rate(stats['prefill_tokens'], stats['prefill_s'])}")
    print(f"decode:  {rate(stats['decode_tokens'], stats['decode_s'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
