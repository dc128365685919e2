"""
The training run's configuration, shared by every entry point that plans, trains or compares runs: base_train's
flags and their validation, the model config they resolve to, the batch geometry, the horizon and the schedules.

    args = parse_args(["--depth=4", "--num_iterations=100"])    # what base_train, launch, compare and base_loss use

Parsing touches no model weights and no data; errors exit with one line that says what to change.
"""

import argparse
import contextlib
import difflib
import importlib.util
import os
import sys

import torch

from nanochat.cli import ArgumentParser
from nanochat.common import autodetect_device_type, device_available, get_dist_info
from nanochat.gpt import GPT, GPTConfig, REFINEMENT_PRESETS, STATE_UPDATES

# Model flags that map one-to-one onto GPTConfig fields; None means "not given on the command line".
MODEL_FLAGS = ["n_loops", "T_recursion", "n_sup_train", "n_sup_inference", "activation_fn", "state_update",
               "sample_n_sup", "detach_between_steps", "activation_checkpointing", "supervision_weight_base",
               "improvement_reward_scale"]
SAMPLE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "The opposite of hot is", "import os\n"]
DEFAULT_TOTAL_BATCH_SIZE = 524288  # tokens per optimizer step, as nanochat: 1 or 8 GPUs train the same model


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


def build_parser():
    p = ArgumentParser(prog="python -m scripts.base_train", allow_abbrev=False,
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
    preset = GPTConfig.with_refinement_preset(args.preset, vocab_size=1) if args.preset else None
    for name in MODEL_FLAGS:
        if getattr(args, name) is not None:
            values[name], sources[name] = getattr(args, name), "flag"
        elif preset and name in ("supervision_weight_base", "improvement_reward_scale"):
            values[name], sources[name] = getattr(preset, name), f"preset {args.preset}"
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
    args.dtype = args.dtype or default_dtype(args.device_type)
    args.model_tag = args.model_tag or f"d{args.depth}"
    args.argv = argv
    return args


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


def data_problem():
    """None when the tokenizer and the training shards exist; else what is missing and the command that makes it."""
    from nanochat.common import get_base_dir
    from nanochat.dataset import DatasetError, parquets_for_split
    tok_dir = os.path.join(get_base_dir(), "tokenizer")
    if not os.path.isdir(tok_dir):
        return f"no tokenizer in {tok_dir}: train one first with python -m scripts.tok_train"
    try:
        parquets_for_split("train")
    except DatasetError as e:
        return str(e)
    return None


def default_dtype(device_type):
    """The autocast dtype when --dtype is not given: bfloat16 where it is fast (CUDA), float32 elsewhere."""
    return "bfloat16" if device_type == "cuda" else "float32"


def autocast_for(device_type, dtype):
    """The context a forward runs in: bf16 autocast, or nothing for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


def data_ranks(args, rank):
    """The data ranks (of world_size x grad_accum) that process `rank` reads in its micro-steps, in order."""
    return [rank * args.grad_accum + j for j in range(args.grad_accum)]


def batch_geometry(args):
    return {"world_size": args.world_size, "device_batch_size": args.device_batch_size,
            "max_seq_len": args.max_seq_len, "grad_accum": args.grad_accum}


def model_config(args, vocab_size):
    """The GPTConfig a parsed run trains."""
    return GPTConfig(vocab_size=vocab_size, **args.model_config)


def meta_model(config):
    """The model without memory or init (meta device): enough for parameter and FLOP counts."""
    with torch.device("meta"):
        return GPT(config)
