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
import math
import os
import sys

import torch

from nanochat.cli import OneLineErrors
from nanochat.common import autodetect_device_type, device_available, get_dist_info
from nanochat.files import get_base_dir
from nanochat.gpt import ACTIVATIONS, GPT, GPTConfig, REFINEMENT_PRESETS, STATE_UPDATES

# Model flags that map one-to-one onto GPTConfig fields; None means "not given on the command line".
MODEL_FLAGS = ["n_loops", "T_recursion", "n_sup_train", "n_sup_inference", "activation_fn", "state_update",
               "sample_n_sup", "detach_between_steps", "activation_checkpointing", "supervision_weight_base",
               "improvement_reward_scale", "halt_head", "n_prelude", "n_coda"]
SAMPLE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "The opposite of hot is", "import os\n"]
# The compute-optimal batch, as nanochat HEAD derives it: B_REF tokens for the depth-12 reference at its horizon
# D_REF, and B ~ D^BATCH_EXPONENT for other horizons (Power Lines, arXiv 2505.13738), rounded to a power of 2.
B_REF = 2 ** 19
BATCH_EXPONENT = 0.383
REFERENCE_DEPTH = 12
MAX_DEVICE_BATCH = 32  # the largest automatic micro-batch (nanochat's default device batch)
QUIET_ACCUMULATION = 64  # more micro-batches per step than this gets a warning: a small model made to crawl
PLANNER_MFU = 0.40  # model FLOPs utilisation a compiled bf16 run of this size reaches; stated in every plan
# Per-GPU collective bandwidths the plan prices communication at (bytes/s): PCIe-class and NVLink-class nodes
LINK_BANDWIDTHS = {"PCIe": 25e9, "NVLink": 300e9}


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


# auto starts averaging at 300 steps: at CPU scale the average hurt every 128-step run and helped every run of 337 to
# 990 steps (dev/LOG.md, "When the weight average helps").
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
    p = OneLineErrors(prog="python -m scripts.base_train", allow_abbrev=False,
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
    model.add_argument("--activation_fn", choices=list(ACTIVATIONS), default=None)
    model.add_argument("--state_update", choices=list(STATE_UPDATES), default=None,
                       help="how the recursion writes into its states y, z (residual = unbounded sum)")
    model.add_argument("--sample_n_sup", type=str2bool, nargs="?", const=True, default=None,
                       help="train a random number of supervision steps per batch, 1..2*n_sup_train-1")
    model.add_argument("--detach_between_steps", type=str2bool, nargs="?", const=True, default=None)
    model.add_argument("--activation_checkpointing", type=str2bool, nargs="?", const=True, default=None)
    model.add_argument("--n_prelude", type=int, default=None, help="plain blocks before the recursion, run once")
    model.add_argument("--n_coda", type=int, default=None, help="plain blocks after the recursion, before the head")
    model.add_argument("--halt_head", type=str2bool, nargs="?", const=True, default=None,
                       help="train a per-token halting head alongside (base_loss/base_sample --halt=head:THRESHOLD)")
    model.add_argument("--preset", default=None, help=f"refinement preset: {', '.join(REFINEMENT_PRESETS)}")
    model.add_argument("--supervision_weight_base", type=float, default=None)
    model.add_argument("--improvement_reward_scale", type=float, default=None)
    batch = p.add_argument_group("batch (effective batch = processes x device batch x accumulation)")
    batch.add_argument("--device_batch_size", type=int, default=None,
                       help=f"sequences per micro-batch per process (default: the largest, up to {MAX_DEVICE_BATCH}, "
                            f"that the memory estimate fits in the device)")
    batch.add_argument("--total_batch_size", type=int, default=None,
                       help=f"tokens per optimizer step (default: compute-optimal, {B_REF:,} at depth 12 and growing "
                            f"as the token horizon^{BATCH_EXPONENT}, with learning rates scaled by sqrt(batch / "
                            f"{B_REF:,}); unless --gradient_accumulation_steps is given); the accumulation follows")
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
    runtime.add_argument("--compile", type=str2bool, nargs="?", const=True, default=None,
                         help="torch.compile the layer visits (default: on for CUDA, off elsewhere)")
    runtime.add_argument("--sharding", choices=["auto", "ddp", "fsdp"], default="auto",
                         help="ddp: every process holds the whole model (optimizer state sharded, ZeRO-1); fsdp: "
                              "weights, gradients, optimizer state and EMA sharded over the processes (FSDP2, under "
                              "torchrun, 1 process too), for models data parallelism cannot hold; auto: fsdp only "
                              "when data parallelism cannot hold one sequence per device")
    runtime.add_argument("--device_memory_gb", type=float, default=None,
                         help="memory per device for the batch fit and the plan (default: the device's, or free RAM "
                              "/ processes on CPU); plans for a GPU you do not have with --dry_run")
    runtime.add_argument("--peak_tflops", type=float, default=None,
                         help="the device's dense bf16 peak, for MFU and the plan's time (default: the GPU's entry "
                              "in the peak-FLOPs table)")
    runtime.add_argument("--dry_run", type=str2bool, nargs="?", const=True, default=False,
                         help="print the plan (batch, memory, FLOPs, time, cost) and exit without touching disk")
    runtime.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                         help="autocast dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    runtime.add_argument("--seed", type=int, default=42)
    output = p.add_argument_group("evaluation and output")
    output.add_argument("--eval_every", type=int, default=250, help="steps between validation evals (0 = end only)")
    output.add_argument("--eval_tokens", type=int, default=10 * 524288,
                        help="validation tokens per eval, rounded down to whole rows of --max_seq_len (the same rows "
                             "on any number of processes)")
    output.add_argument("--early_stop", type=int, default=0, metavar="K",
                        help="stop (saved, exit 0) after K evaluations in a row whose final supervision step's "
                             "validation bpb did not beat the best of the run (0 = off)")
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
    resume.add_argument("--allow_data_change", type=str2bool, nargs="?", const=True, default=False,
                        help="--resume even when the data differs from the checkpoint's (its fingerprint of shard "
                             "names, sizes and row groups): a warning instead of a refusal")
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


def parse_args(argv=None, world_size=None, check_hardware=True, vocab_size=None):
    """Parse and validate every flag without touching a model or data; errors exit with what to change.

    vocab_size: the vocabulary the batch is planned for (default: the tokenizer's, or GPTConfig's before one exists)."""
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
    for name in ("eval_every", "early_stop", "sample_every", "save_every", "save_every_minutes", "keep_last", "matrix_lr",
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
    args.device_type = args.device_type or autodetect_device_type()
    if args.device_type not in ("cuda", "cpu", "mps"):
        parser.error(f"--device_type={args.device_type} is not one of cuda, cpu, mps")
    if check_hardware and not args.dry_run and not device_available(args.device_type):
        parser.error(f"--device_type={args.device_type} is not available on this machine; "
                     f"use --device_type={autodetect_device_type()}")
    args.dtype = args.dtype or default_dtype(args.device_type)
    args.compile = args.device_type == "cuda" if args.compile is None else args.compile
    for name in ("device_batch_size", "gradient_accumulation_steps", "total_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    for name in ("device_memory_gb", "peak_tflops"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name}={getattr(args, name)} must be > 0")
    if args.sharding == "fsdp" and check_hardware and not args.dry_run and not get_dist_info()[0]:
        parser.error("--sharding=fsdp needs a process group: launch with torchrun --standalone --nproc_per_node=N "
                     "-m scripts.base_train -- ... (N=1 works)")
    args.world_size = world_size
    args.sharding_requested = args.sharding  # auto is settled by the batch's memory budget (resolve_sharding)
    args.plan_vocab_size = vocab_size or tokenizer_vocab_size() or GPTConfig.vocab_size  # tok_train's default too
    resolve_batch(parser, args)
    if args.sharding == "fsdp" and check_hardware and not args.dry_run:
        problem = host_ram_problem(args)
        if problem:  # before anything is built: every rank would otherwise die swapping or OOM-killed mid-build
            parser.error(problem)
    if args.num_iterations is not None and args.num_iterations < 1:
        parser.error(f"--num_iterations={args.num_iterations} must be >= 1")
    if args.eval_tokens < args.max_seq_len:
        parser.error(f"--eval_tokens={args.eval_tokens} is less than one validation row (--max_seq_len="
                     f"{args.max_seq_len} tokens); raise it")
    if args.max_cost is not None and not args.gpu_hourly_price:
        parser.error("--max_cost needs --gpu_hourly_price to know what an hour costs")
    for name in ("warmup_ratio", "warmdown_ratio", "final_lr_frac"):
        if not 0 <= getattr(args, name) <= 1:
            parser.error(f"--{name}={getattr(args, name)} must be between 0 and 1")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error(f"--warmup_steps={args.warmup_steps} must be >= 0")
    if args.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        parser.error("--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'")
    args.model_tag = args.model_tag or f"d{args.depth}"
    args.argv = argv
    return args


# ---------------------------------------------------------------------------------------------------- the batch
def resolve_batch(parser, args):
    """Fill in args.device_batch_size, grad_accum, total_batch_size and lr_scale, and say why (args.batch_notes).

    Unset, the total batch is compute-optimal for the run's horizon (nanochat HEAD's rule) with learning rates
    scaled by sqrt(batch / B_REF), and the device batch is the largest that the memory estimate fits."""
    world, T = args.world_size, args.max_seq_len
    accum, total, notes = args.gradient_accumulation_steps, args.total_batch_size, []
    resolve_sharding(args, device_memory(args))
    notes.append(args.sharding_note)
    args.lr_scale = 1.0
    if total is None and accum is None:
        total, horizon, reference = optimal_batch(args)
        micro = (args.device_batch_size or 1) * T * world  # a whole number of micro-batches (sequences) per process
        total = max(1, round(total / micro)) * micro
        args.lr_scale = math.sqrt(total / B_REF)
        notes.append(f"total batch {total:,} tokens: compute-optimal for a horizon of {horizon:.3g} tokens "
                     f"({B_REF:,} at the depth-{REFERENCE_DEPTH} horizon {reference:.3g}, x (horizon ratio)^"
                     f"{BATCH_EXPONENT}, a power of 2); learning rates x {args.lr_scale:.4f} = sqrt(batch / "
                     f"{B_REF:,}). --total_batch_size sets it (and keeps the learning rates)")
    if args.device_batch_size is None:
        per_rank = total // (T * world) if total is not None and total % (T * world) == 0 else MAX_DEVICE_BATCH
        args.device_batch_size, why = fit_device_batch(args, per_rank)
        if args.device_batch_size is None:
            parser.error(why)
        notes.append(why)
    tokens_per_micro = args.device_batch_size * T * world
    if total is not None:
        given = "--total_batch_size" if args.total_batch_size is not None else "the compute-optimal total batch"
        if total < tokens_per_micro or total % tokens_per_micro:
            multiple = max(1, round(total / tokens_per_micro)) * tokens_per_micro
            parser.error(f"{given}={total} is not a multiple of processes x device_batch_size x max_seq_len = "
                         f"{world} x {args.device_batch_size} x {T} = {tokens_per_micro}; pass "
                         f"--total_batch_size={multiple} (or another multiple of {tokens_per_micro}), or "
                         f"--gradient_accumulation_steps=N for N x {tokens_per_micro} tokens per step")
        if accum is not None and accum != total // tokens_per_micro:
            parser.error(f"--total_batch_size={total} implies gradient accumulation {total // tokens_per_micro}, "
                         f"but --gradient_accumulation_steps={accum}; give only one of them")
        accum = total // tokens_per_micro
    args.grad_accum = accum
    args.total_batch_size = tokens_per_micro * accum
    if accum > QUIET_ACCUMULATION:
        notes.append(f"WARNING: {accum} micro-batches per optimizer step ({args.total_batch_size:,} tokens in "
                     f"micro-batches of {tokens_per_micro:,}): each step will be slow; a smaller --total_batch_size "
                     f"(or --gradient_accumulation_steps) makes more, faster steps")
    args.batch_notes = notes


def resolve_sharding(args, memory_at):
    """Settle --sharding=auto in args.sharding (ddp, unless data parallelism cannot hold one sequence per device even
    with activation checkpointing: then fsdp) for memory_at = (bytes per device, where from); args.sharding_note says
    why."""
    args.sharding = args.sharding_requested
    args.sharding_note = sharding_reason(args, memory_at)


def sharding_reason(args, memory_at):
    from nanochat import memory
    if args.sharding != "auto":
        return f"sharding {args.sharding} (--sharding)"
    if args.world_size == 1:
        args.sharding = "ddp"
        return "sharding ddp (auto): one process, nothing to shard"
    memory_bytes, where = memory_at
    usable = memory.usable_bytes(memory_bytes)
    config = model_config(args, args.plan_vocab_size).replace(activation_checkpointing=True)
    need = {kind: memory.estimate_memory(config, 1, args.dtype, args.world_size, keeps_ema(args), kind)["total"]
            for kind in ("ddp", "fsdp")}
    args.sharding = "ddp" if need["ddp"] <= usable else "fsdp"
    return (f"sharding {args.sharding} (auto): at 1 sequence with activation checkpointing data parallelism needs "
            f"~{need['ddp'] / 1e9:.1f} GB per device, sharded over {args.world_size} processes ~{need['fsdp'] / 1e9:.1f}"
            f" GB; {usable / 1e9:.0f} GB usable ({where})"
            + ("" if args.sharding == "fsdp" else "; replicated is cheaper in communication (--sharding=fsdp forces)"))


def optimal_batch(args):
    """(tokens per step, the run's horizon in tokens, the reference horizon): B_REF x (D / D_REF)^BATCH_EXPONENT
    rounded to a power of 2, D from --target_flops or the data ratio (as the horizon rule, iterations aside)."""
    model = meta_model(model_config(args, args.plan_vocab_size))
    reference_args = argparse.Namespace(**{**vars(args), "depth": REFERENCE_DEPTH, "n_embd": None, "n_head": None,
                                           "n_kv_head": None})
    reference_args.model_config, _ = resolve_model_config(reference_args)
    reference = args.target_param_data_ratio * meta_model(model_config(reference_args, args.plan_vocab_size)).num_params()
    if args.target_flops:
        horizon = args.target_flops / model.estimate_flops()
    else:
        horizon = args.target_param_data_ratio * model.num_params()
    return 2 ** round(math.log2(B_REF * (horizon / reference) ** BATCH_EXPONENT)), horizon, reference


def fit_device_batch(args, sequences_per_rank, max_batch=MAX_DEVICE_BATCH, allow_checkpointing=False, memory_at=None):
    """(the largest device batch up to max_batch that divides sequences_per_rank and fits the device's memory, why);
    (None, what to do) when not even one sequence fits. Activation checkpointing, when allowed and needed, is turned
    on in args.model_config. The launcher fits its table's batch with this function too. memory_at: (bytes per
    device, where the number comes from), default device_memory(args)."""
    from nanochat import memory
    memory_bytes, where = memory_at or device_memory(args)
    resolve_sharding(args, (memory_bytes, where))
    config = model_config(args, args.plan_vocab_size)
    fit = memory.fit_micro_batch(config, sequences_per_rank, min(max_batch, sequences_per_rank), memory_bytes,
                                 args.dtype, args.world_size, allow_checkpointing=allow_checkpointing,
                                 ema=keeps_ema(args), sharding=args.sharding)
    if fit is None:
        return None, (f"not even one sequence of {args.max_seq_len} tokens fits in {memory_bytes / 1e9:.0f} GB per "
                      f"device ({where}; estimate): turn on --activation_checkpointing, or lower --max_seq_len or "
                      f"--depth")
    batch, checkpointing = fit
    if checkpointing and not config.activation_checkpointing:
        args.model_config = {**args.model_config, "activation_checkpointing": True}
        args.config_sources = {**args.config_sources, "activation_checkpointing": "turned on to fit memory"}
    need = memory.estimate_memory(model_config(args, args.plan_vocab_size), batch, args.dtype, args.world_size,
                                  keeps_ema(args), args.sharding)["total"]
    return batch, (f"device batch {batch}: the largest of at most {max_batch} that divides the {sequences_per_rank} "
                   f"sequences per process and fits ~{need / 1e9:.1f} GB in {memory.usable_bytes(memory_bytes) / 1e9:.0f}"
                   f" GB usable of {memory_bytes / 1e9:.0f} GB ({where})")


def device_memory(args):
    """(bytes per device, where the number comes from): --device_memory_gb, the GPU's, or free RAM per process."""
    if args.device_memory_gb:
        return int(args.device_memory_gb * 1e9), "--device_memory_gb"
    if args.device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    return free_ram_per_process(args.world_size)


def free_ram_per_process(processes):
    """(bytes, where from): the machine's free RAM shared by the processes, the memory of a CPU run."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // processes, f"{available / 1e9:.0f} GB free RAM / {processes} processes"


def host_ram_available():
    """Bytes of RAM the machine can still give (MemAvailable: free plus reclaimable cache), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_ram_problem(args):
    """A line saying why this node's RAM cannot hold what the FSDP ranks on it build before sharding, or None."""
    from nanochat import memory
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's processes on this node
    need = memory.sharded_build_host_bytes(model_config(args, args.plan_vocab_size), processes)
    have = host_ram_available()
    if have is None or need <= have:
        return None
    return (f"--sharding=fsdp: each of the {processes} processes on this node builds the whole float32 model in host "
            f"RAM before sharding it, ~{need / 1e9:.1f} GB in all, but {have / 1e9:.1f} GB is available; run fewer "
            f"processes per node, or on a node with more RAM")


def keeps_ema(args):
    """Whether the run keeps an EMA copy of the weights (--ema_decay; auto depends on the run's length)."""
    if args.num_iterations is None:  # the length comes from --target_flops or a data ratio: count the copy unless off
        return args.ema_decay != 0
    return ema_decay_for(args, args.num_iterations) > 0


def tokenizer_vocab_size():
    """The trained tokenizer's vocabulary size, or None when there is none yet (looked up without creating a dir)."""
    from nanochat.tokenizer import get_tokenizer
    if not os.path.isdir(tokenizer_path()):
        return None
    return get_tokenizer().get_vocab_size()


def tokenizer_path():
    return os.path.join(get_base_dir(create=False), "tokenizer")


def plan_lines(args):
    """What a run will do and cost, from its flags alone: base_train --dry_run prints these and exits."""
    from nanochat import memory
    config = model_config(args, args.plan_vocab_size)
    model = meta_model(config)
    iterations, source = num_iterations_for(args, model)
    memory_bytes, where = device_memory(args)
    est = memory.estimate_memory(config, args.device_batch_size, args.dtype, args.world_size, keeps_ema(args),
                                 args.sharding)
    flops_per_step = model.estimate_flops() * args.total_batch_size
    lines = [f"processes    {args.world_size} x {args.device_type}, {args.dtype}, compile {args.compile}",
             f"model        depth {config.n_layer}, width {config.n_embd}, n_loops {config.n_loops}, "
             f"{config.n_sup_train} supervision steps, vocab {config.vocab_size:,}: {model.num_params():,} parameters",
             f"batch        {args.world_size} x {args.device_batch_size} sequences x {args.max_seq_len} tokens x "
             f"{args.grad_accum} accumulation = {args.total_batch_size:,} tokens per step",
             *[f"             {note}" for note in args.batch_notes],
             f"memory       ~{est['total'] / 1e9:.1f} GB per device (nanochat/memory.py) of "
             f"{memory.usable_bytes(memory_bytes) / 1e9:.0f} GB usable ({memory_bytes / 1e9:.0f} GB, {where})"
             + ("" if est["total"] <= memory.usable_bytes(memory_bytes) else "  -> predicted OUT OF MEMORY"),
             f"compute      {model.estimate_flops():.3e} FLOPs per token x {args.total_batch_size:,} tokens = "
             f"{flops_per_step:.3e} FLOPs per step; {iterations} steps ({source})"]
    peak = peak_flops(args)
    if peak:
        seconds = flops_per_step / (args.world_size * peak * PLANNER_MFU)
        cost = (f", ${seconds * iterations / 3600 * args.gpu_hourly_price * args.world_size:,.2f} at "
                f"${args.gpu_hourly_price}/GPU-hour" if args.gpu_hourly_price else "")
        lines.append(f"time         {peak / 1e12:,.0f} TFLOP/s per device at {PLANNER_MFU:.0%} MFU: {seconds:.2f} s per "
                     f"step, {seconds * iterations / 3600:.2f} h for {iterations} steps{cost}")
        lines += budget_lines(args, seconds, iterations)
    else:
        lines.append("time         unknown: no GPU in the peak-FLOPs table here; --peak_tflops gives one")
    return lines + sharding_lines(args, config, memory_bytes)


def peak_flops(args, device=0):
    """The device's dense bf16 peak FLOP/s, for MFU and the plan's time: --peak_tflops, else the GPU's entry in the
    peak-FLOPs table (nanochat/common.py), else None (no MFU shown)."""
    from nanochat.common import gpu_peak_flops
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if args.device_type == "cuda" and torch.cuda.is_available():
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return None


def sharding_lines(args, config, memory_bytes):
    """The sharding chosen, why, what each choice needs per device and sends per step (the plan's 'sharding')."""
    from nanochat import memory
    if args.world_size == 1:
        return [f"sharding     {args.sharding}: one process, no collectives"]
    lines = [f"sharding     {args.sharding_note.removeprefix('sharding ')}"]
    for kind in ("ddp", "fsdp"):
        need = memory.estimate_memory(config, args.device_batch_size, args.dtype, args.world_size, keeps_ema(args),
                                      kind)["total"]
        sent, gathers = memory.collective_bytes(config, kind, args.world_size, args.grad_accum, args.dtype)
        at = ", ".join(f"{sent / bandwidth:.2f} s at {bandwidth / 1e9:.0f} GB/s ({link})"
                       for link, bandwidth in LINK_BANDWIDTHS.items())
        what = (f"{sum(gathers.values())} parameter all-gathers per micro-step, x {args.grad_accum} micro-steps"
                if gathers else "one gradient reduce-scatter and one weight all-gather per step")
        host = (f"; needs ~{memory.sharded_build_host_bytes(config, 1) / 1e9:.1f} GB host RAM per process at start "
                f"(the whole float32 model, built before sharding)" if kind == "fsdp" else "")
        lines.append(f"  {kind}{' (chosen)' if kind == args.sharding else ''}: ~{need / 1e9:.1f} GB per device"
                     f"{'' if need <= memory.usable_bytes(memory_bytes) else ' (does NOT fit)'}; sends "
                     f"~{sent / 1e9:.1f} GB per device per step ({what}): {at} if not overlapped with compute{host}")
    return lines


def budget_lines(args, seconds_per_step, iterations):
    """What --max_hours buys at the planned step time: steps and tokens (the run stops there, saved)."""
    if not args.max_hours:
        return []
    steps = int(args.max_hours * 3600 / seconds_per_step)
    return [f"budget       --max_hours={args.max_hours:g}: ~{min(steps, iterations):,} of {iterations:,} steps, "
            f"~{min(steps, iterations) * args.total_batch_size:,} tokens at {PLANNER_MFU:.0%} MFU"]


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
    from nanochat.dataset import DatasetError, parquets_for_split
    tok_dir = tokenizer_path()
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


def training_loaders(args, tokenizer, rank, resume_states, device="cpu"):
    """Process `rank`'s training loaders, one per micro-step (its data ranks), at their resume positions (None: the
    start). Also how a resume checks that the saved positions exist in the current data."""
    from nanochat.dataloader import DataLoader
    return [DataLoader(tokenizer, args.device_batch_size, args.max_seq_len, "train", device=device, rank=data_rank,
                       world_size=args.world_size * args.grad_accum, resume_state=state)
            for data_rank, state in zip(data_ranks(args, rank), resume_states)]


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
