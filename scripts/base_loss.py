"""
Evaluate a checkpoint: train and validation bits per byte for every supervision step, the refinement %, and samples.

    python -m scripts.base_loss --model_tag=d4
    torchrun --standalone --nproc_per_node=8 -m scripts.base_loss -- --model_tag=d12 --step=best
    python -m scripts.base_loss --model_tag=d4 --n_sup=8     # past the trained steps: do extra steps help or hurt?
    python -m scripts.base_loss --model_tag=d4 --halt=kl:0.0005   # + validation with per-token adaptive halting
    python -m scripts.base_loss --model_tag=d4 --hops   # hops corpus: accuracy by hop count at every step (only)
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split
import argparse
import itertools
import json
import os
import sys

from nanochat import checkpoint as ckpt
from nanochat.cli import DefaultsHelp, Exit, OneLineErrors, missing_package
from nanochat.collectives import RankFailure
from nanochat.common import autocast_for, autodetect_device_type, compute_cleanup, compute_init, default_dtype, print0
from nanochat.data.dataloader import evaluation_batches, evaluation_size
from nanochat.data.dataset import DatasetError, corpus_identity, data_dir, iter_documents, read_source
from nanochat.data.tokenizer import get_token_bytes
from nanochat.eval.hops_eval import HopsEvalError, evaluate_hops, format_hops, plot_hops
from nanochat.eval.loss_eval import (
    evaluate_bpb,
    evaluate_bpb_halting,
    format_halting,
    format_state,
    format_steps,
    refinement,
)
from nanochat.files import atomic_write_bytes, exit_on_write_error
from nanochat.model.engine import Engine
from nanochat.model.gpt import GPTConfig
from nanochat.model.halting import Halting, check_halting
from nanochat.train.config import SAMPLE_PROMPTS


def parse_args(argv=None):
    p = OneLineErrors(prog="python -m scripts.base_loss", allow_abbrev=False,
               formatter_class=DefaultsHelp)
    ckpt.checkpoint_flags(p)
    p.add_argument("--device_batch_size", type=int, default=8, help="sequences per forward")
    p.add_argument("--max_seq_len", type=int, default=None, help="tokens per row (default: the model's sequence_len)")
    p.add_argument("--split_tokens", type=int, default=2 * 524288,
                   help="tokens evaluated per split, rounded down to whole rows of --max_seq_len (the same rows on any "
                        "number of processes)")
    p.add_argument("--n_sup", type=int, default=None,
                   help="supervision steps to run (default: n_sup_inference); more than were trained is allowed")
    p.add_argument("--device_type", default="", help="cuda | cpu | mps (default: autodetect: cuda, mps, cpu)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="autocast dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    p.add_argument("--sample_tokens", type=int, default=24, help="tokens generated per sample prompt")
    p.add_argument("--halt", type=halting_arg, default=None,
                   help="also evaluate validation with per-token adaptive halting, RULE:THRESHOLD (kl, rms or head) "
                        "(default: off)")
    p.add_argument("--hops", action="store_true",
                   help="instead of bpb: exact-match accuracy by hop count at supervision steps 1..2*n_sup_inference "
                        "(--n_sup: 1..n_sup) on the validation documents of the hops corpus (docs/reasoning.md)")
    p.add_argument("--hops_docs", type=int, default=2000, help="--hops: validation documents evaluated")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    for name in ("device_batch_size", "max_seq_len", "split_tokens", "n_sup", "sample_tokens", "hops_docs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.hops and args.halt:
        p.error("--hops evaluates every supervision step, not halting; drop --halt (or run base_loss twice)")
    return args


def halting_arg(text):
    try:
        return Halting.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None):
    args = parse_args(argv)
    device_type = args.device_type or autodetect_device_type()
    ddp, rank, _, world_size, device = compute_init(device_type)
    try:
        # n_sup past the trained steps is a legitimate question; the engine samples up to n_sup_inference
        overrides = {"n_sup_inference": args.n_sup} if args.n_sup else {}
        model, tokenizer, meta, model_tag, _ = ckpt.open_checkpoint(args.model_tag, args.step, device, **overrides)
    except ValueError as e:
        raise Exit(f"base_loss: {e}")
    if args.hops:
        return evaluate_hops_corpus(args, model, tokenizer, meta, model_tag, device_type, (device, rank, world_size))
    n_sup = model.config.n_sup_inference
    if args.halt:
        try:
            check_halting(model, args.halt)
        except ValueError as e:
            raise Exit(f"base_loss: --halt: {e}")
    T = args.max_seq_len or model.config.sequence_len
    if T > model.config.sequence_len:
        raise Exit(f"base_loss: --max_seq_len={T} is longer than the {model.config.sequence_len}-token "
                         f"context the model was trained with; use at most {model.config.sequence_len}")
    if n_sup > model.config.n_sup_train:
        print0(f"note: {n_sup} supervision steps, past the {model.config.n_sup_train} the model was trained with")
    B = args.device_batch_size
    rows, steps = evaluation_size(args.split_tokens, B, T, world_size)  # the same rows on any number of processes
    dtype = args.dtype or default_dtype(device_type)
    autocast = autocast_for(device_type, dtype)
    print0(f"evaluating {model_tag} step {meta['step']} with {n_sup} supervision steps on "
           f"{rows * T:,} tokens per split")
    results = {"model_tag": model_tag, "step": meta["step"], "n_sup": n_sup, "split_tokens": rows * T}
    token_bytes = get_token_bytes(device=device)
    for split in ("train", "val"):
        try:
            bpb, state = evaluate_bpb(model, lambda: evaluation_batches(tokenizer, B, T, split, args.split_tokens, rank,
                                                                        world_size, device),
                                      steps, token_bytes, n_sup=n_sup, autocast=autocast)
        except RankFailure as e:
            raise Exit(f"base_loss: {e}")
        results[f"{split}_bpb"], results[f"{split}_refinement"] = bpb, refinement(bpb)
        results[f"{split}_state"] = state
        print0(f"{split:5s} bpb per step: {format_steps(bpb)} | refinement "
               f"{100 * refinement(bpb):.1f}%")
        if model.config.n_loops:  # a plain GPT has no recursion to diagnose
            print0(f"{split:5s} recursion state per step: {format_state(state)}")
    if args.halt:
        results["val_halting"] = validate_with_halting(args, model, tokenizer, T, steps, token_bytes, autocast,
                                                       (device, rank, world_size))
    if rank == 0:
        engine = Engine(model, tokenizer, autocast=lambda: autocast_for(device_type, dtype))
        completions = engine.complete(SAMPLE_PROMPTS, max_tokens=args.sample_tokens, temperature=0, n_sup=n_sup)
        for prompt, completion in zip(SAMPLE_PROMPTS, completions):
            print0(f"sample: {prompt!r} -> {completion!r}")
        path = os.path.join(ckpt.model_dir(model_tag), f"base_loss_step{meta['step']:06d}.json")
        with exit_on_write_error("base_loss"):
            atomic_write_bytes(path, json.dumps(results, indent=2).encode(),
                               ", then run base_loss again to save the results printed above")
        print0(f"results: {path}")
    compute_cleanup()
    return results


def validate_with_halting(args, model, tokenizer, T, steps, token_bytes, autocast, placement):
    """Validation bpb with --halt's per-token halting, printed, and {halting, bpb, mean_steps, n_sup}."""
    device, rank, world_size = placement
    n_sup = model.config.n_sup_inference
    try:
        bpb, mean_steps = evaluate_bpb_halting(
            model, lambda: evaluation_batches(tokenizer, args.device_batch_size, T, "val", args.split_tokens, rank,
                                              world_size, device), steps, token_bytes, args.halt, autocast=autocast)
    except RankFailure as e:
        raise Exit(f"base_loss: --halt={args.halt}: {e}")
    print0(format_halting("val", args.halt, bpb, mean_steps, n_sup))
    return {"halting": str(args.halt), "bpb": bpb, "mean_steps": mean_steps, "n_sup": n_sup}


def evaluate_hops_corpus(args, model, tokenizer, meta, model_tag, device_type, placement):
    """--hops: accuracy by hop count at every supervision step on the validation documents of the hops corpus,
    printed, saved as hops_eval_step<N>.json beside the checkpoints, and plotted there when matplotlib is installed."""
    device, rank, world_size = placement
    # the validation shard, not documents regenerated from the recorded seed: exactly what training held out,
    # and the split the other evaluations read
    source = read_source(data_dir()) or ""
    if not source.startswith("synthetic: --synthetic=hops"):
        raise Exit(f"base_loss: --hops needs the hops corpus, but {data_dir()} holds "
                   f"{source or 'no recorded corpus'}; build it with python -m nanochat.dataset --synthetic=hops "
                   "(or point NANOCHAT_DATA_DIR at it)")
    try:
        documents = list(itertools.islice(iter_documents("val"), args.hops_docs))
        corpus = corpus_identity()
    except DatasetError as e:
        raise Exit(f"base_loss: {e}")
    if meta.get("data") and meta["data"]["fingerprint"] != corpus["fingerprint"]:
        print0(f"note: {model_tag} was trained on data {meta['data']['fingerprint']}, not this corpus "
               f"({corpus['fingerprint']}); evaluating on it anyway")
    n_sup_inference = GPTConfig.from_dict(meta["model_config"]).n_sup_inference  # as trained: --n_sup overrides it
    n_steps = args.n_sup or 2 * n_sup_inference
    print0(f"evaluating {model_tag} step {meta['step']} on {len(documents):,} validation documents of {source} "
           f"for supervision steps 1..{n_steps} (trained with {model.config.n_sup_train})")
    dtype = args.dtype or default_dtype(device_type)
    try:
        result = evaluate_hops(model, tokenizer, documents, n_steps, batch_size=args.device_batch_size, device=device,
                               autocast=autocast_for(device_type, dtype), rank=rank, world_size=world_size)
    except (HopsEvalError, RankFailure) as e:
        raise Exit(f"base_loss: --hops: {e}")
    results = {"model_tag": model_tag, "step": meta["step"], "n_sup_train": model.config.n_sup_train,
               "n_sup_inference": n_sup_inference,
               "steps": n_steps, "corpus": source, **result}
    print0(format_hops(results))
    if rank == 0:
        stem = os.path.join(ckpt.model_dir(model_tag), f"hops_eval_step{meta['step']:06d}")
        with exit_on_write_error("base_loss"):
            atomic_write_bytes(stem + ".json", json.dumps(results, indent=2).encode(),
                               ", then run base_loss --hops again to save the results printed above")
        print0(f"results: {stem}.json")
        try:
            plot_hops(results, stem + ".png", title=f"{model_tag} step {meta['step']}")
            print0(f"plot: {stem}.png")
        except ImportError as e:
            print0(f"note: no plot: {missing_package(e, 'the plot')}")
    compute_cleanup()
    return results


if __name__ == "__main__":
    main()
