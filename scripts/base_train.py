"""
Pretrain the TRM GPT.

    python -m scripts.base_train --depth=4 --num_iterations=100                      # one process
    torchrun --standalone --nproc_per_node=8 -m scripts.base_train -- --depth=12     # one node, 8 GPUs

Every step logs the final-step loss, every supervision step's loss, refinement %, gradient norm, lr, time, tokens/s,
MFU, memory, ETA and cost; evaluation measures validation bits per byte for every supervision step. Checkpoints go
to $NANOCHAT_BASE_DIR/base_checkpoints/<model_tag>/ and a killed run resumes exactly with --resume.

Data order: the token stream is split into world_size x grad_accum data ranks and micro-step j of process r reads
data rank r*grad_accum + j, so the data of a step depends only on the effective batch: 2 GPUs x 1 accumulation
and 1 GPU x 2 accumulation see the same tokens in every step.
"""

import argparse
import contextlib
import difflib
import importlib.util
import json
import math
import os
import sys
import time

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from nanochat import checkpoint_manager as ckpt
from nanochat import lifecycle
from nanochat.cli import ArgumentParser
from nanochat.common import (RankFailure, atomic_write_bytes, autodetect_device_type, compute_cleanup, compute_init,
                             device_available, get_base_dir, get_dist_info, gpu_peak_flops, print0,
                             raise_if_any_rank_failed, run_on_rank0)
from nanochat.gpt import GPTConfig, REFINEMENT_PRESETS, STATE_UPDATES
from nanochat.loss_eval import evaluate_bpb, format_state, format_steps, refinement
from nanochat.optim import clipped_step, reduce_gradients
from nanochat.report import Health, MetricsError, MetricsLog, format_duration, write_summary

# Model flags that map one-to-one onto GPTConfig fields; None means "not given on the command line".
MODEL_FLAGS = ["n_loops", "T_recursion", "n_sup_train", "n_sup_inference", "activation_fn", "state_update",
               "sample_n_sup", "detach_between_steps", "activation_checkpointing", "supervision_weight_base",
               "improvement_reward_scale"]
SAMPLE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "The opposite of hot is", "import os\n"]
DEFAULT_TOTAL_BATCH_SIZE = 524288  # tokens per optimizer step, as nanochat: 1 or 8 GPUs train the same model


class ExitWithMessage(Exception):
    """A run that must stop: printed without a traceback, with its exit code."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------------- command line
def ema_decay_arg(value):
    if value == "auto":
        return value
    try:
        decay = float(value)
    except ValueError:
        decay = -1.0
    if not 0 <= decay < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: a decay in [0, 1) (0 = off, 0.999 averages over about the last "
                                         f"1000 steps), or auto")
    return decay


# Measured at CPU scale (README): auto's average lost 0.05-0.11 bpb in all six 128-step runs and gained 0.01-0.06 in
# all six runs of 337-990 steps; the boundary lies somewhere between, so auto starts averaging at 300 steps.
EMA_AUTO_MIN_STEPS = 300


def ema_decay_for(args, num_iterations):
    """The EMA decay of the run: --ema_decay, or for auto an average over about the last tenth of a long run."""
    if args.ema_decay != "auto":
        return args.ema_decay
    return 1 - 10 / num_iterations if num_iterations >= EMA_AUTO_MIN_STEPS else 0.0


def str2bool(value):
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


class Parser(ArgumentParser):
    def error(self, message):  # one line that says what is wrong (the usage is in --help)
        raise SystemExit(f"{self.prog.rsplit('.', 1)[-1]}: error: {message}")


def build_parser():
    p = Parser(prog="python -m scripts.base_train", allow_abbrev=False,
               formatter_class=argparse.ArgumentDefaultsHelpFormatter,
               description="Pretrain the TRM GPT. Flags take --name=value or --name value (--name-with-dashes too).")
    model = p.add_argument_group("model (unset = preset, then the defaults written in nanochat/gpt.py)")
    model.add_argument("--depth", type=int, default=12, help="layers; width = 64*depth, head dim 128")
    model.add_argument("--n_embd", type=int, default=None, help="override the width derived from --depth")
    model.add_argument("--n_head", type=int, default=None, help="override the head count (n_embd/128)")
    model.add_argument("--n_kv_head", type=int, default=None, help="key/value heads (GQA); default n_head")
    model.add_argument("--max_seq_len", type=int, default=2048)
    model.add_argument("--n_loops", type=int, default=None, help="latent updates per layer visit (0 = plain GPT)")
    model.add_argument("--T_recursion", type=int, default=None, help="sweeps per supervision step")
    model.add_argument("--n_sup_train", type=int, default=None, help="supervision steps in training")
    model.add_argument("--n_sup_inference", type=int, default=None, help="supervision steps at inference")
    model.add_argument("--activation_fn", choices=["relu_squared", "swiglu", "geglu"], default=None)
    model.add_argument("--state_update", choices=list(STATE_UPDATES), default=None,
                       help="how the recursion writes into its states y, z (residual = unbounded sum)")
    model.add_argument("--sample_n_sup", type=str2bool, nargs="?", const=True, default=None,
                       help="train a random number of supervision steps per batch, 1..2*n_sup_train-1")
    model.add_argument("--detach_between_steps", type=str2bool, nargs="?", const=True, default=None)
    model.add_argument("--activation_checkpointing", type=str2bool, nargs="?", const=True, default=None)
    model.add_argument("--preset", default=None, help=f"refinement preset: {', '.join(REFINEMENT_PRESETS)}")
    model.add_argument("--supervision_weight_base", type=float, default=None)
    model.add_argument("--improvement_reward_scale", type=float, default=None)
    batch = p.add_argument_group("batch (effective batch = processes x device batch x accumulation)")
    batch.add_argument("--device_batch_size", type=int, default=32, help="sequences per micro-batch per process")
    batch.add_argument("--total_batch_size", type=int, default=None,
                       help=f"tokens per optimizer step (default {DEFAULT_TOTAL_BATCH_SIZE:,} unless "
                            f"--gradient_accumulation_steps is given); the accumulation follows from it")
    batch.add_argument("--gradient_accumulation_steps", type=int, default=None, help="micro-batches per step")
    horizon = p.add_argument_group("horizon (first given wins: iterations, FLOPs, ratio)")
    horizon.add_argument("--num_iterations", type=int, default=None)
    horizon.add_argument("--target_flops", type=float, default=None)
    horizon.add_argument("--target_param_data_ratio", type=float, default=20.0, help="training tokens per parameter")
    optim = p.add_argument_group("optimisation")
    optim.add_argument("--matrix_lr", type=float, default=0.02, help="Muon lr for transformer matrices")
    optim.add_argument("--embedding_lr", type=float, default=0.2, help="AdamW lr for the embedding")
    optim.add_argument("--unembedding_lr", type=float, default=0.004, help="AdamW lr for lm_head")
    optim.add_argument("--weight_decay", type=float, default=0.0)
    optim.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm (0 = off)")
    optim.add_argument("--ema_decay", type=ema_decay_arg, default="auto",
                       help="evaluate, sample and publish an exponential moving average of the weights: a decay in "
                            "[0, 1) (0 = off; TRM uses 0.999), or auto = 1 - 10 / num_iterations, an average over "
                            f"about the last tenth of the run, for runs of {EMA_AUTO_MIN_STEPS}+ steps (off below: "
                            "it hurt short runs)")
    optim.add_argument("--warmup_steps", type=int, default=None, help="lr warmup steps (overrides the ratio)")
    optim.add_argument("--warmup_ratio", type=float, default=0.02, help="lr warmup as a fraction of the run")
    optim.add_argument("--warmdown_ratio", type=float, default=0.2, help="final fraction with linear lr decay")
    optim.add_argument("--final_lr_frac", type=float, default=0.0, help="lr at the end, as a fraction of peak")
    runtime = p.add_argument_group("runtime")
    runtime.add_argument("--device_type", default="", help="cuda | cpu | mps (default: autodetect)")
    runtime.add_argument("--compile", type=str2bool, nargs="?", const=True, default=False, help="torch.compile")
    runtime.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                         help="autocast dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    runtime.add_argument("--seed", type=int, default=42)
    output = p.add_argument_group("evaluation and output")
    output.add_argument("--eval_every", type=int, default=250, help="steps between validation evals (0 = end only)")
    output.add_argument("--eval_tokens", type=int, default=10 * 524288, help="validation tokens per eval")
    output.add_argument("--sample_every", type=int, default=2000, help="steps between samples (0 = end only)")
    output.add_argument("--sample_tokens", type=int, default=16, help="tokens generated per sample prompt")
    output.add_argument("--save_every", type=int, default=0, help="steps between checkpoints (0 = end only)")
    output.add_argument("--save_every_minutes", type=float, default=30,
                        help="wall-clock minutes between checkpoints (0 = off)")
    output.add_argument("--keep_last", type=int, default=3, help="checkpoints kept besides the best (0 = keep all)")
    output.add_argument("--backup_dir", default=None,
                        help="also copy each checkpoint, in the background, to this fsspec URL (gs://bucket/dir, "
                             "s3://..., a local path); --keep_last applies there too, and --resume pulls from it "
                             "when the local directory is empty")
    output.add_argument("--run", default=os.environ.get("WANDB_RUN", "dummy"),
                        help="wandb run name ('dummy' = no wandb); the default comes from $WANDB_RUN")
    output.add_argument("--tensorboard", nargs="?", const="", default=None, metavar="DIR",
                        help="also log to TensorBoard, in DIR (default <run dir>/tensorboard)")
    output.add_argument("--model_tag", default=None, help="checkpoint directory name (default d<depth>)")
    budget = p.add_argument_group("budgets (stop cleanly with a checkpoint when spent)")
    budget.add_argument("--max_hours", type=float, default=None, help="wall-clock hours for the whole run")
    budget.add_argument("--max_cost", type=float, default=None, help="dollars for the whole run")
    budget.add_argument("--gpu_hourly_price", type=float, default=None, help="dollars per GPU-hour (cost reports)")
    resume = p.add_argument_group(
        "resume and preemption", "SIGTERM or SIGINT (Ctrl-C): every process finishes the step in progress, saves a "
        "checkpoint and exits with 128 + the signal number (143, 130); a second signal more than 5 s later exits at "
        "once. Allow one step plus one save: torchrun SIGKILLs its workers --shutdown-timeout seconds (default 30) "
        "after it forwards the signal.")
    resume.add_argument("--resume", type=str2bool, nargs="?", const=True, default=False,
                        help="continue from the latest loadable checkpoint of --model_tag")
    resume.add_argument("--resume_from_step", type=int, default=None, help="continue from this checkpoint step")
    resume.add_argument("--overwrite", type=str2bool, nargs="?", const=True, default=False,
                        help="start over on a tag that holds a run: the old run is moved to <tag>.replaced-<date>/")
    return p


def reject_unknown(parser, unknown):
    """argparse says 'unrecognized arguments'; say which flag was probably meant."""
    known = [opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")]
    for arg in unknown:
        name = arg.split("=", 1)[0]
        if not name.startswith("-"):
            parser.error(f"unexpected argument {arg!r}: flags take the form --name=value")
        guess = difflib.get_close_matches(name.replace("-", "_"), known, n=1, cutoff=0.5)
        hint = f"; did you mean {guess[0]}?" if guess else "; see --help for the list of flags"
        parser.error(f"unknown flag {name}{hint}")


def resolve_model_config(args):
    """The effective GPTConfig fields and where each came from: explicit flag > --preset > gpt.py default."""
    defaults = GPTConfig(vocab_size=1)
    given = lambda value, default: default if value is None else value  # noqa: E731 - 0 is a value, not "unset"
    n_embd = given(args.n_embd, args.depth * 64)
    values = {"n_layer": args.depth, "n_embd": n_embd, "sequence_len": args.max_seq_len,
              "n_head": given(args.n_head, max(1, n_embd // 128))}
    values["n_kv_head"] = given(args.n_kv_head, values["n_head"])
    sources = {"n_layer": "--depth", "sequence_len": "--max_seq_len",
               "n_embd": "--n_embd" if args.n_embd is not None else "derived from --depth (64 per layer)",
               "n_head": "--n_head" if args.n_head is not None else "derived (head dim 128)",
               "n_kv_head": "--n_kv_head" if args.n_kv_head is not None else "= n_head"}
    preset = REFINEMENT_PRESETS[args.preset] if args.preset else None
    for name in MODEL_FLAGS:
        if getattr(args, name) is not None:
            values[name], sources[name] = getattr(args, name), "flag"
        elif preset and name in ("supervision_weight_base", "improvement_reward_scale"):
            values[name] = preset[0] if name == "supervision_weight_base" else preset[1]
            sources[name] = f"preset {args.preset}"
        else:
            values[name], sources[name] = getattr(defaults, name), "gpt.py default"
    if args.n_sup_inference is None:
        values["n_sup_inference"], sources["n_sup_inference"] = values["n_sup_train"], "= n_sup_train"
    return values, sources


def parse_args(argv=None, world_size=None, check_hardware=True):
    """Parse and validate every flag without touching a model or data; errors exit with what to change."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # torchrun ... -m scripts.base_train -- --depth=12
        argv = argv[1:]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        reject_unknown(parser, unknown)
    world_size = world_size or get_dist_info()[3]
    if args.preset is not None and args.preset not in REFINEMENT_PRESETS:
        parser.error(f"unknown --preset={args.preset}; valid presets: {', '.join(REFINEMENT_PRESETS)}")
    if args.depth < 1:
        parser.error(f"--depth={args.depth} must be >= 1")
    for name in ("n_embd", "n_head", "n_kv_head", "max_seq_len", "sample_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    for name in ("eval_every", "sample_every", "save_every", "save_every_minutes", "keep_last", "matrix_lr",
                 "embedding_lr", "unembedding_lr", "weight_decay", "grad_clip", "gpu_hourly_price"):
        if getattr(args, name) is not None and not getattr(args, name) >= 0:
            parser.error(f"--{name}={getattr(args, name)} must be >= 0 (see --help for what 0 means)")

    for name in ("target_flops", "target_param_data_ratio", "max_hours", "max_cost"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name}={getattr(args, name)} must be > 0")
    if args.overwrite and (args.resume or args.resume_from_step is not None):
        parser.error("--overwrite starts over and --resume continues: give one of them")
    args.model_config, args.config_sources = resolve_model_config(args)
    try:
        GPTConfig(vocab_size=1, **args.model_config)
    except ValueError as e:
        parser.error(f"{e} (set --n_embd/--n_head/--n_kv_head or pick another --depth)")
    if args.device_batch_size < 1:
        parser.error(f"--device_batch_size={args.device_batch_size} must be >= 1")
    tokens_per_micro = args.device_batch_size * args.max_seq_len * world_size
    accum = args.gradient_accumulation_steps
    if accum is not None and accum < 1:
        parser.error(f"--gradient_accumulation_steps={accum} must be >= 1")
    total = args.total_batch_size
    if total is None and accum is None:
        total = DEFAULT_TOTAL_BATCH_SIZE
    if total is not None:
        given = "--total_batch_size" if args.total_batch_size is not None else "the default --total_batch_size"
        if total < tokens_per_micro or total % tokens_per_micro:
            multiple = max(1, round(total / tokens_per_micro)) * tokens_per_micro
            parser.error(f"{given}={total} is not a multiple of processes x device_batch_size x max_seq_len = "
                         f"{world_size} x {args.device_batch_size} x {args.max_seq_len} = {tokens_per_micro}; pass "
                         f"--total_batch_size={multiple} (or another multiple of {tokens_per_micro}), or "
                         f"--gradient_accumulation_steps=N for N x {tokens_per_micro} tokens per step")
        if accum is not None and accum != total // tokens_per_micro:
            parser.error(f"--total_batch_size={total} implies gradient accumulation {total // tokens_per_micro}, "
                         f"but --gradient_accumulation_steps={accum}; give only one of them")
        accum = total // tokens_per_micro
    args.grad_accum = accum
    args.total_batch_size = tokens_per_micro * accum
    args.world_size = world_size
    if args.num_iterations is not None and args.num_iterations < 1:
        parser.error(f"--num_iterations={args.num_iterations} must be >= 1")
    if args.eval_tokens < tokens_per_micro:
        parser.error(f"--eval_tokens={args.eval_tokens} is less than one validation batch ({tokens_per_micro} "
                     f"tokens = processes x device_batch_size x max_seq_len); raise it or lower the batch")
    if args.max_cost is not None and not args.gpu_hourly_price:
        parser.error("--max_cost needs --gpu_hourly_price to know what an hour costs")
    for name in ("warmup_ratio", "warmdown_ratio", "final_lr_frac"):
        if not 0 <= getattr(args, name) <= 1:
            parser.error(f"--{name}={getattr(args, name)} must be between 0 and 1")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error(f"--warmup_steps={args.warmup_steps} must be >= 0")
    args.device_type = args.device_type or autodetect_device_type()
    if args.device_type not in ("cuda", "cpu", "mps"):
        parser.error(f"--device_type={args.device_type} is not one of cuda, cpu, mps")
    if check_hardware and not device_available(args.device_type):
        parser.error(f"--device_type={args.device_type} is not available on this machine; "
                     f"use --device_type={autodetect_device_type()}")
    if args.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        parser.error("--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'")
    args.dtype = args.dtype or ("bfloat16" if args.device_type == "cuda" else "float32")
    args.model_tag = args.model_tag or f"d{args.depth}"
    args.argv = argv
    return args


# ---------------------------------------------------------------------------------------------------- schedules
def lr_multiplier(step, num_iterations, warmup_steps, warmdown_ratio, final_lr_frac):
    warmdown_steps = round(warmdown_ratio * num_iterations)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step <= num_iterations - warmdown_steps:
        return 1.0
    progress = (num_iterations - step) / warmdown_steps
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(step):
    """Momentum warms up from 0.85 to 0.95 over the first 300 steps, as in nanochat."""
    frac = min(step / 300, 1)
    return (1 - frac) * 0.85 + frac * 0.95


def num_iterations_for(args, model):
    if args.num_iterations:
        return args.num_iterations, "--num_iterations"
    flops_per_step = model.estimate_flops() * args.total_batch_size
    if args.target_flops:
        return max(1, round(args.target_flops / flops_per_step)), f"--target_flops={args.target_flops:g}"
    tokens = args.target_param_data_ratio * model.num_params()
    return max(1, round(tokens / args.total_batch_size)), f"--target_param_data_ratio={args.target_param_data_ratio:g}"


# ---------------------------------------------------------------------------------------------------- the run
def autocast_for(args):
    if args.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=args.device_type, dtype=torch.bfloat16)


def print_config(args, num_iterations, horizon_source, model, tokens_per_step):
    print0(f"model config ({args.model_tag}):")
    for name, value in model.config.to_dict().items():
        print0(f"  {name:26s} = {value!s:14s} ({args.config_sources.get(name, 'tokenizer')})")
    print0(f"parameters: {model.num_params():,}   FLOPs per token (training step): {model.estimate_flops():.3e}")
    print0(f"batch: {args.world_size} processes x {args.device_batch_size} x {args.max_seq_len} tokens x "
           f"{args.grad_accum} accumulation = {tokens_per_step:,} tokens per step")
    print0(f"horizon: {num_iterations} steps ({horizon_source}), {num_iterations * tokens_per_step:,} tokens")


def check_data_ready():
    """Fail before building anything when the tokenizer or shards are missing, naming the command that makes them."""
    from nanochat.dataset import DatasetError, parquets_for_split
    tok_dir = os.path.join(get_base_dir(), "tokenizer")
    if not os.path.isdir(tok_dir):
        raise ExitWithMessage(f"no tokenizer in {tok_dir}: train one first with python -m scripts.tok_train")
    try:
        parquets_for_split("train")
    except DatasetError as e:
        raise ExitWithMessage(str(e))


def start_or_resume(args, model_config, tokenizer, rank):
    """The resume point (step, meta, weights, rank state), checked against this run; or None for a fresh run, on a tag
    that holds no other run (--overwrite moves one aside). Every check passes before anything is written."""
    resuming = args.resume or args.resume_from_step is not None
    try:
        if args.backup_dir:
            ckpt.Backup.location(args.backup_dir, args.model_tag)  # a bad URL stops here, not after the first save
        if not resuming:
            found = ckpt.check_fresh_start(args.model_tag, args.overwrite, args.backup_dir)
            if args.overwrite:  # on every rank, so the ranks wait for rank 0's move together
                error = None
                if rank == 0 and found:
                    try:
                        print0(f"--overwrite: moved the previous run ({found}) to {ckpt.move_aside(args.model_tag)}")
                    except OSError as e:
                        error = e
                raise_if_any_rank_failed(error, "moving the previous run aside")
            return None
        which = args.resume_from_step if args.resume_from_step is not None else "latest"
        point = ckpt.load_resume_point(args.model_tag, which, rank, args.backup_dir)
        step, meta = point[:2]
        ckpt.check_tokenizer(meta, tokenizer, f"checkpoint {args.model_tag} step {step}")
    except (ckpt.CheckpointError, RankFailure) as e:
        raise ExitWithMessage(f"cannot {'resume' if resuming else 'start'}: {e}")
    diffs = ckpt.resume_differences(meta, model_config, batch_geometry(args))
    if diffs:
        raise ExitWithMessage(f"cannot resume {args.model_tag} from step {step}: the checkpoint was written with a "
                              f"different configuration:\n  " + "\n  ".join(diffs) +
                              "\nPass the checkpoint's values, or start a new run with another --model_tag.")
    return point


def data_ranks(args, rank):
    """The data ranks (of world_size x grad_accum) that process `rank` reads in its micro-steps, in order."""
    return [rank * args.grad_accum + j for j in range(args.grad_accum)]


def batch_geometry(args):
    return {"world_size": args.world_size, "device_batch_size": args.device_batch_size,
            "max_seq_len": args.max_seq_len, "grad_accum": args.grad_accum}


def write_nan_diagnostic(path, step, losses, history, model_config):
    record = {"step": step, "step_losses": losses, "last_good": history[-5:], "model_config": model_config,
              "advice": "Lower --matrix_lr (2x), use a milder --preset (extreme -> aggressive), keep --grad_clip=1.0,"
                        " and resume from the last good checkpoint with --resume."}
    atomic_write_bytes(path, json.dumps(record, indent=2).encode())


def oom_message(args):
    smaller = max(1, args.device_batch_size // 2)
    accum = args.grad_accum * args.device_batch_size // smaller
    return (f"CUDA out of memory at --device_batch_size={args.device_batch_size}, --max_seq_len={args.max_seq_len}, "
            f"--depth={args.depth}. Lower --device_batch_size (e.g. {smaller}) with --gradient_accumulation_steps="
            f"{accum} to keep the same effective batch; or lower --max_seq_len or --depth; or turn on "
            f"--activation_checkpointing"
            + ("" if args.model_config["detach_between_steps"] else
               ", or --detach_between_steps (one supervision step's activations alive at a time)") + ".")


def train(args):
    ddp, rank, local_rank, world_size, device = compute_init(args.device_type, args.seed)
    if ddp and world_size != args.world_size:
        raise ExitWithMessage(f"internal: parsed for {args.world_size} processes, running {world_size}")
    check_data_ready()
    from nanochat.dataloader import DataLoader
    from nanochat.tokenizer import get_token_bytes, get_tokenizer
    tokenizer = get_tokenizer()
    model_config = {**args.model_config, "vocab_size": tokenizer.get_vocab_size()}
    resume = start_or_resume(args, model_config, tokenizer, rank)

    model = ckpt.build_model(model_config, device)
    model.train()
    optimizers = model.setup_optimizers(unembedding_lr=args.unembedding_lr, embedding_lr=args.embedding_lr,
                                        matrix_lr=args.matrix_lr, weight_decay=args.weight_decay)
    num_iterations, horizon_source = num_iterations_for(args, model)
    warmup_steps = args.warmup_steps if args.warmup_steps is not None else round(args.warmup_ratio * num_iterations)
    tokens_per_step = args.total_batch_size
    flops_per_token = model.estimate_flops()
    peak_flops = gpu_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    print_config(args, num_iterations, horizon_source, model, tokens_per_step)
    no_room = ckpt.disk_room_problem(args.model_tag, ckpt.checkpoint_bytes(model), args.keep_last)
    if no_room:
        raise ExitWithMessage(no_room)

    # the EMA's copy of the model is what evaluation, samples and checkpoints see; training goes on in `model`
    ema_decay = ema_decay_for(args, num_iterations)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(ema_decay)) if ema_decay else None
    print0("weights published (evaluated, sampled, saved): "
           + (f"EMA with decay {ema_decay:.4f} (--ema_decay={args.ema_decay})" if ema else "the trained weights"))
    published = ema.module if ema else model
    start_step, prior_seconds, loader_states = 0, 0.0, [None] * args.grad_accum
    if resume:
        start_step, meta = resume[:2]
        loader_states = ckpt.restore(resume, model, optimizers, ema)
        prior_seconds = meta["elapsed_seconds"]
        print0(f"resumed {args.model_tag} from step {start_step} ({format_duration(prior_seconds)} already spent)")
    if args.compile:
        model.compile_layer_visits()
    loaders = [DataLoader(tokenizer, args.device_batch_size, args.max_seq_len, "train", device=device,
                          rank=data_rank, world_size=world_size * args.grad_accum, resume_state=loader_states[j])
               for j, data_rank in enumerate(data_ranks(args, rank))]
    consumed = [loader.state_dict() for loader in loaders]  # the loaders' positions after the last trained batch
    prefetched = next(loaders[0]) if start_step < num_iterations else None
    token_bytes = get_token_bytes(device=device)
    run_dir = ckpt.model_dir(args.model_tag)
    os.makedirs(run_dir, exist_ok=True)
    if rank == 0:
        ckpt.remove_partial_saves(args.model_tag)
    metrics = MetricsLog(run_dir, args, rank, start_step if resume else None)
    health, history = Health(), []
    val_bpb, last_eval_step = None, None
    price_per_hour = (args.gpu_hourly_price or 0) * world_size
    backup = ckpt.Backup.location(args.backup_dir, args.model_tag, args.keep_last).start() \
        if args.backup_dir and rank == 0 else None

    with lifecycle.StopSignals() as signals:
        control = lifecycle.RunControl(args, prior_seconds, price_per_hour, signals)
        elapsed = control.elapsed

        def save(step):
            meta = {"model_config": model_config, "config_sources": args.config_sources, "user_flags": args.argv,
                    "train_config": {k: v for k, v in vars(args).items() if k not in ("model_config", "config_sources")},
                    "batch_geometry": batch_geometry(args), "num_iterations": num_iterations,
                    "tokenizer_fingerprint": tokenizer.fingerprint(),
                    "val_bpb": val_bpb if last_eval_step == step else None, "elapsed_seconds": elapsed(),
                    "cost": control.cost(), "dataloader": consumed[0]}
            try:
                path = ckpt.save_checkpoint(args.model_tag, step, published, optimizers, meta,
                                            {"loaders": consumed}, rank,
                                            train_model=model if ema else None)
            except ckpt.CheckpointError as e:
                raise ExitWithMessage(str(e), code=5)
            control.saved()
            print0(f"saved checkpoint {path}")

        step, flags = start_step, control.agree(device)  # a budget spent or a signal before the first step
        while True:
            last_step = step == num_iterations
            stop = control.stop_reason(flags)  # agreed by every rank: a signal or a budget, raised on any of them
            if stop:
                print0(f"{stop} at step {step}: saving and stopping")
            steps_due = args.save_every and step % args.save_every == 0
            save_due = (step > start_step and (last_step or stop or flags["save_time"] or steps_due)) or (
                stop and resume is None)
            if save_due:
                save(step)  # before evaluation, so a failing eval can never cost the checkpoint
            hurry = bool(flags["signal"])  # after a signal, only the checkpoint: the grace period is short
            if not hurry and (last_step or stop or (args.eval_every and step % args.eval_every == 0)):
                val_bpb, val_state = run_eval(published, tokenizer, args, device, rank, world_size, token_bytes,
                                              DataLoader)
                if val_bpb:
                    last_eval_step = step
                    metrics.log({"kind": "eval", "step": step, "val_bpb": val_bpb,
                                 "val_refinement": refinement(val_bpb), "state": val_state})
                    if rank == 0 and ckpt.list_steps(args.model_tag)[-1:] == [step]:
                        update_checkpoint_bpb(args.model_tag, step, val_bpb)
            if rank == 0 and not hurry and (last_step or stop or (args.sample_every and step % args.sample_every == 0)):
                run_samples(published, tokenizer, args, metrics, step)
            if rank == 0 and save_due:
                removed = ckpt.prune_checkpoints(args.model_tag, args.keep_last)
                if removed:
                    print0(f"pruned checkpoints at steps {removed} (keeping the last {args.keep_last} and the best)")
                if backup:
                    backup.submit(step)
            if last_step or stop:
                break

            # ---- one optimizer step
            t0 = time.time()
            n_sup = model.train_depth(step)
            sums = torch.zeros(1 + 5 * n_sup, device=device)  # total loss, the step losses, state diagnostics
            try:
                for j, loader in enumerate(loaders):
                    x, y = prefetched if j == 0 else next(loader)
                    with autocast_for(args):
                        loss, aux = model.forward_backward(x, y, loss_scale=1 / args.grad_accum, n_sup=n_sup)
                    sums += torch.cat([loss.view(1), aux["step_losses"], aux["state"].flatten()]).float()
                # the next step's first batch, tokenized while the device still works on this one
                consumed = [loader.state_dict() for loader in loaders]  # what a checkpoint resumes from
                prefetched = next(loaders[0]) if step + 1 < num_iterations else None
                sq_grad_norm = reduce_gradients(optimizers)
            except torch.OutOfMemoryError:
                raise ExitWithMessage(oom_message(args), code=4)
            # the means over micro-steps and ranks, the squared gradient norm, and every rank's stop/save flags:
            # one all_reduce and the step's one host sync
            values, flags = control.reduce(torch.cat([sums / (args.grad_accum * world_size), sq_grad_norm.view(1)]))
            total, losses, state = values[0], values[1:1 + n_sup], values[1 + n_sup:-1]
            grad_norm = math.sqrt(values[-1]) if values[-1] >= 0 else float("nan")
            if not all(math.isfinite(v) for v in losses + [total]):
                path = os.path.join(run_dir, f"nan_diagnostic_step{step:06d}.json")
                if rank == 0:
                    write_nan_diagnostic(path, step, losses, history, model_config)
                raise ExitWithMessage(f"loss is NaN/Inf at step {step} (per-step losses {losses}); stopped without "
                                      f"saving, the last good checkpoint is untouched. Diagnostic: {path}", code=3)
            lrm = lr_multiplier(step, num_iterations, warmup_steps, args.warmdown_ratio, args.final_lr_frac)
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["initial_lr"] * lrm
            for group in optimizers[1].param_groups:
                group["momentum"] = muon_momentum(step)
            clipped_step(optimizers, grad_norm, args.grad_clip)  # skipped when the norm is not finite
            model.zero_grad(set_to_none=True)
            if not math.isfinite(grad_norm):
                raise ExitWithMessage(f"gradient norm is {grad_norm} at step {step}: the update was skipped and the "
                                      f"run stopped; lower --matrix_lr or use a milder --preset, then --resume", code=3)
            if ema:
                ema.update_parameters(model)
            # no device sync for the clock: the optimizer's kernels still running now are waited for by the next
            # step's sync, so in a steady state dt is a whole step
            dt = time.time() - t0
            step += 1

            # ---- log
            history.append({"step": step, "step_losses": losses})
            health.check(step, losses, grad_norm)
            tok_per_sec = tokens_per_step / dt
            mfu = flops_per_token * tok_per_sec / (peak_flops * world_size) if peak_flops else None
            mem_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
            record = {"kind": "train", "step": step, "loss": losses[-1], "total_loss": total, "step_losses": losses,
                      "refinement": refinement(losses), "state": [[round(v, 5) for v in state[4 * s:4 * s + 4]]
                                                                  for s in range(n_sup)],
                      "grad_norm": grad_norm, "lr_multiplier": lrm, "dt": dt, "tok_per_sec": tok_per_sec,
                      "mfu": mfu, "peak_mem_gb": mem_gb, "elapsed_s": elapsed(), "cost": control.cost() or None}
            metrics.log(record)
            print0(metrics.format_step(record, num_iterations))

        if rank == 0:
            write_summary(run_dir, args, step, elapsed(), price_per_hour, model, tokenizer.fingerprint())
        metrics.close()
        if args.backup_dir:  # every rank: the others wait in short collectives while rank 0's uploads drain
            run_on_rank0(backup.close if backup else None, rank)
    if control.exit_code(flags):
        raise ExitWithMessage(f"stopped at step {step} by {stop}: the checkpoint is saved; continue with the same "
                              f"command and --resume", code=control.exit_code(flags))
    return step


def run_eval(model, tokenizer, args, device, rank, world_size, token_bytes, DataLoader):
    """Validation bpb per supervision step; a failure on any rank is reported and skipped by every rank together."""
    try:
        model.eval()
        steps = args.eval_tokens // (args.device_batch_size * args.max_seq_len * world_size)
        bpb, state = evaluate_bpb(model, lambda: DataLoader(tokenizer, args.device_batch_size, args.max_seq_len,
                                                            "val", device=device, rank=rank, world_size=world_size),
                                  steps, token_bytes, autocast=autocast_for(args))
        print0(f"validation bpb per step: {format_steps(bpb)} | refinement "
               f"{100 * refinement(bpb):.1f}%")
        if model.config.n_loops:  # a plain GPT has no recursion: its residual stream's numbers would mislead
            print0(f"recursion state per step: {format_state(state)}")
        return bpb, state
    except RankFailure as e:  # raised on every rank alike: all skip, none waits in a collective
        print0(f"WARNING: {e}; skipped on every rank, training goes on")
        return None, None
    finally:
        model.train()


def run_samples(model, tokenizer, args, metrics, step):
    try:
        from nanochat.engine import Engine
        model.eval()
        completions = Engine(model, tokenizer).complete(SAMPLE_PROMPTS, max_tokens=args.sample_tokens, temperature=0)
        for prompt, completion in zip(SAMPLE_PROMPTS, completions):
            print0(f"sample: {prompt!r} -> {completion!r}")
        metrics.log({"kind": "sample", "step": step, "samples": list(zip(SAMPLE_PROMPTS, completions))})
    except Exception as e:  # noqa: BLE001 - a sample is a courtesy, not a reason to stop
        print0(f"WARNING: sampling failed and was skipped: {type(e).__name__}: {e}")
    finally:
        model.train()


def update_checkpoint_bpb(model_tag, step, val_bpb):
    path = os.path.join(ckpt.step_dir(model_tag, step), "meta.json")
    with open(path) as f:
        meta = json.load(f)
    meta["val_bpb"] = val_bpb
    atomic_write_bytes(path, json.dumps(meta, indent=2).encode())


def main(argv=None):
    args = parse_args(argv)
    try:
        train(args)
    except (ExitWithMessage, MetricsError) as e:
        print(f"base_train: {e}", file=sys.stderr, flush=True)
        compute_cleanup()
        sys.exit(getattr(e, "code", 1))
    compute_cleanup(together=True)


if __name__ == "__main__":
    main()
