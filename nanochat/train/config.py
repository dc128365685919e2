"""
The training run's configuration: base_train's flags, validated once into a frozen RunConfig that holds what the user
asked and what follows from it (the model config, the batch geometry, the learning-rate scale, the sharding and why).

    run_config = parse_args(["--depth=4", "--num_iterations=100"])    # what base_train, launch and compare use

Parsing touches no model weights and no data; errors exit with one line that says what to change. Planning the batch
and the memory is nanochat/train/planning.py's; nothing is written onto the parsed flags, and a later stage that derives
something (the launcher's memory fit) makes a new RunConfig with dataclasses.replace.
"""

import argparse
import dataclasses
import difflib
import importlib.util
import os
import sys
from typing import Any

from nanochat.cli import DefaultsHelp, OneLineErrors, missing_package
from nanochat.common import autodetect_device_type, default_dtype, device_available, get_dist_info
from nanochat.data.dataloader import ROW_LAYOUTS
from nanochat.data.dataset import SYNTHETIC, DatasetError, data_dir, parquets_for_split, read_source
from nanochat.data.tokenizer import get_tokenizer
from nanochat.files import get_base_dir, model_tag_arg
from nanochat.model.gpt import ACTIVATIONS, N_SUP_SAMPLERS, REFINEMENT_PRESETS, STATE_DTYPES, STATE_UPDATES, GPTConfig
from nanochat.train import attention
from nanochat.train.compile import COMPILE_SCOPES, compile_scope_for
from nanochat.train.planning import (
    B_REF,
    BATCH_EXPONENT,
    EMA_AUTO_MIN_STEPS,
    MAX_DEVICE_BATCH,
    MODEL_FLAGS,
    PlanError,
    host_ram_problem,
    plan_batch,
    resolve_model_config,
)
from nanochat.train.probe import PROBES

PRESET_FIELDS = ("supervision_weight_base", "improvement_reward_scale")  # what --preset sets
SAMPLE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "The opposite of hot is", "import os\n"]


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


def str2bool(value):
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def n_sup_sampler(value):
    """--sample_n_sup's value: a boolean, or the name of a sampler (gpt.N_SUP_SAMPLERS)."""
    return value if value in N_SUP_SAMPLERS else str2bool(value)


def gpt_default(name):
    """What a model flag takes when unset, read from GPTConfig's defaults (gpt.py, where the guides edit them)."""
    value = {f.name: f.default for f in dataclasses.fields(GPTConfig)}[name]
    if name == "n_sup_inference":
        return "(default: --n_sup_train's)"
    if name in PRESET_FIELDS:
        return f"(default: --preset's, else {value}, gpt.py's)"
    return f"(default: {value}, gpt.py's)"


def preset_default():
    """--preset's help when unset: the two values gpt.py holds, and the preset they equal, if one."""
    values = tuple({f.name: f.default for f in dataclasses.fields(GPTConfig)}[name] for name in PRESET_FIELDS)
    same = [name for name, preset in REFINEMENT_PRESETS.items() if preset == values]
    return f"(default: none: gpt.py's {values[0]} and {values[1]}{f', which are {same[0]}' if same else ''})"


def build_parser():
    p = OneLineErrors(prog="python -m scripts.base_train", allow_abbrev=False, formatter_class=DefaultsHelp,
               description="Pretrain the TRM GPT. Flags take --name=value or --name value (--name-with-dashes too).")
    model = p.add_argument_group("model (unset = preset, then the defaults written in nanochat/model/gpt.py)")
    model.add_argument("--depth", type=int, default=12, help="layers; width = 64*depth, head dim 128")
    model.add_argument("--n_embd", type=int, default=None, help="override the width (default: 64 x --depth)")
    model.add_argument("--n_head", type=int, default=None, help="override the head count (default: n_embd/128)")
    model.add_argument("--n_kv_head", type=int, default=None, help="key/value heads (GQA) (default: n_head)")
    model.add_argument("--max_seq_len", type=int, default=2048, help="tokens per row (the context)")
    model.add_argument("--n_loops", type=int, default=None,
                       help=f"latent updates per layer visit (0 = plain GPT) {gpt_default('n_loops')}")
    model.add_argument("--T_recursion", type=int, default=None,
                       help=f"sweeps per supervision step {gpt_default('T_recursion')}")
    model.add_argument("--n_sup_train", type=int, default=None,
                       help=f"supervision steps in training {gpt_default('n_sup_train')}")
    model.add_argument("--n_sup_inference", type=int, default=None,
                       help=f"supervision steps at inference {gpt_default('n_sup_inference')}")
    model.add_argument("--activation_fn", choices=list(ACTIVATIONS), default=None, help=gpt_default("activation_fn"))
    model.add_argument("--state_update", choices=list(STATE_UPDATES), default=None,
                       help="how the recursion writes into its states y, z (residual = unbounded sum) "
                            f"{gpt_default('state_update')}")
    model.add_argument("--state_dtype", choices=list(STATE_DTYPES), default=None,
                       help=f"dtype of the recursion state x, y, z under autocast {gpt_default('state_dtype')}")
    model.add_argument("--sample_n_sup", type=n_sup_sampler, nargs="?", const=True, default=None,
                       help="train a random number of supervision steps per batch: true = uniform on "
                            f"1..2*n_sup_train-1, or one of {', '.join(N_SUP_SAMPLERS)} {gpt_default('sample_n_sup')}")
    model.add_argument("--detach_between_steps", type=str2bool, nargs="?", const=True, default=None,
                       help=f"carry y, z detached into the next supervision step {gpt_default('detach_between_steps')}")
    model.add_argument("--backprop_steps", type=int, default=None,
                       help="with --detach_between_steps: detach every k-th step (truncated backpropagation; 1 = TRM) "
                            f"{gpt_default('backprop_steps')}")
    model.add_argument("--activation_checkpointing", type=str2bool, nargs="?", const=True, default=None,
                       help=f"recompute each layer visit in backward {gpt_default('activation_checkpointing')}")
    model.add_argument("--n_prelude", type=int, default=None,
                       help=f"plain blocks before the recursion, run once {gpt_default('n_prelude')}")
    model.add_argument("--n_coda", type=int, default=None,
                       help=f"plain blocks after the recursion, before the head {gpt_default('n_coda')}")
    model.add_argument("--halt_head", type=str2bool, nargs="?", const=True, default=None,
                       help="train a per-token halting head alongside (base_loss/base_sample --halt=head:THRESHOLD) "
                            f"{gpt_default('halt_head')}")
    model.add_argument("--preset", default=None,
                       help=f"refinement preset, setting {' and '.join(PRESET_FIELDS)}: "
                            f"{', '.join(f'{k} {v}' for k, v in REFINEMENT_PRESETS.items())} {preset_default()}")
    model.add_argument("--supervision_weight_base", type=float, default=None,
                       help=f"how much later steps outweigh earlier ones {gpt_default('supervision_weight_base')}")
    model.add_argument("--improvement_reward_scale", type=float, default=None,
                       help=f"reward for improving on the previous step {gpt_default('improvement_reward_scale')}")
    model.add_argument("--consistency_weight", type=float, default=None,
                       help="what each step after the first pays for moving the answer (relative squared move), so "
                            f"later steps settle instead of drifting {gpt_default('consistency_weight')}")
    batch = p.add_argument_group("batch (effective batch = processes x device batch x accumulation)")
    batch.add_argument("--device_batch_size", type=int, default=None,
                       help=f"sequences per micro-batch per process (default: the largest, up to {MAX_DEVICE_BATCH}, "
                            f"that the memory estimate fits in the device)")
    batch.add_argument("--total_batch_size", type=int, default=None,
                       help=f"tokens per optimizer step (default: compute-optimal, {B_REF:,} at depth 12 and growing "
                            f"as the token horizon^{BATCH_EXPONENT}, with learning rates scaled by sqrt(batch / "
                            f"{B_REF:,}); unless --gradient_accumulation_steps is given); the accumulation follows")
    batch.add_argument("--gradient_accumulation_steps", type=int, default=None,
                       help="micro-batches per step (default: what --total_batch_size needs)")
    batch.add_argument("--rows", choices=("auto", *ROW_LAYOUTS), default="auto",
                       help="stream: rows cut from the token stream, so most start mid-document (every token trains; "
                            "text); documents: each row starts at a document, holds whole ones, the rest unscored "
                            "(a corpus whose tokens need their document's start); auto: documents on a generated "
                            "corpus (python -m nanochat.dataset --synthetic), stream otherwise")
    horizon = p.add_argument_group("horizon (first given wins: iterations, FLOPs, ratio)")
    horizon.add_argument("--num_iterations", type=int, default=None,
                         help="optimizer steps (default: from --target_flops, else --target_param_data_ratio)")
    horizon.add_argument("--target_flops", type=float, default=None,
                         help="training FLOPs (default: from --target_param_data_ratio)")
    horizon.add_argument("--target_param_data_ratio", type=float, default=20.0, help="training tokens per parameter")
    optim = p.add_argument_group("optimisation")
    optim.add_argument("--matrix_lr", type=float, default=0.02, help="Muon lr for transformer matrices")
    optim.add_argument("--embedding_lr", type=float, default=0.2, help="AdamW lr for the embedding")
    optim.add_argument("--unembedding_lr", type=float, default=0.004, help="AdamW lr for lm_head")
    optim.add_argument("--weight_decay", type=float, default=0.0, help="decoupled weight decay, AdamW and Muon alike")
    optim.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm (0 = off)")
    optim.add_argument("--ema_decay", type=ema_decay_arg, default="auto",
                       help="evaluate, sample and publish an exponential moving average of the weights: a decay in "
                            "[0, 1) (0 = off; TRM uses 0.999), or auto = 1 - 10 / num_iterations, an average over "
                            f"about the last tenth of the run, for runs of {EMA_AUTO_MIN_STEPS}+ steps (off below: "
                            "it hurt short runs)")
    optim.add_argument("--warmup_steps", type=int, default=None,
                       help="lr warmup steps (default: --warmup_ratio of the run)")
    optim.add_argument("--warmup_ratio", type=float, default=0.02, help="lr warmup as a fraction of the run")
    optim.add_argument("--warmdown_ratio", type=float, default=0.2, help="final fraction with linear lr decay")
    optim.add_argument("--final_lr_frac", type=float, default=0.0, help="lr at the end, as a fraction of peak")
    optim.add_argument("--n_sup_warmup", type=float, default=0.5,
                       help="a step-count curriculum (looped_nanochat's loop warmup): train at most 1 supervision step "
                            "at first, the cap rising linearly by n_sup_train every this fraction of the run, so a "
                            "drawn count's tail opens late (0 = off; nanochat/train/depth.py)")
    runtime = p.add_argument_group("runtime")
    runtime.add_argument("--device_type", default="", help="cuda | cpu | mps (default: autodetect: cuda, mps, cpu)")
    runtime.add_argument("--threads", type=int, default=None,
                         help="CPU threads, on --device_type=cpu (default: OMP_NUM_THREADS if set, else the cores this "
                              "process may use that other work leaves free, measured at the start)")
    runtime.add_argument("--compile", type=str2bool, nargs="?", const=True, default=None,
                         help="torch.compile the model in regions (default: on for CUDA, off elsewhere)")
    runtime.add_argument("--compile_scope", choices=["auto", *COMPILE_SCOPES], default="auto",
                         help="what --compile compiles as one region: layer (one layer visit, serving every layer, "
                              "loop and step: compile time flat in the depth) or model (the embedding and each whole "
                              "sweep); auto: model for a plain GPT (--n_loops=0), layer for the recursion, FSDP and "
                              "activation checkpointing")
    runtime.add_argument("--head_chunks", type=int, default=None,
                         help="the training head's chunks per micro-batch (default: the fewest the memory estimate "
                              "holds at the device batch, one compiled region where it can)")
    runtime.add_argument("--diagnostics_every", type=int, default=10,
                         help="steps between measurements of the recursion's state (rms of y, z and the update; "
                              "the log shows the last measured); 1 = every step")
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
    runtime.add_argument("--attention", choices=attention.CHOICES, default="auto",
                         help="the SDPA kernel on CUDA: auto times each on the first batch's shape and keeps the "
                              "fastest (logged); or flash, cudnn, efficient, math")
    runtime.add_argument("--seed", type=int, default=42, help="initial weights, data order and samples")
    output = p.add_argument_group("evaluation and output")
    output.add_argument("--eval_every", type=int, default=250, help="steps between validation evals (0 = end only)")
    output.add_argument("--probe", choices=PROBES, default="none",
                        help="hops: a depth probe; --probe_share of the training tokens are hops documents, and every "
                             "eval reports accuracy by hop count at every supervision step (docs/reasoning.md)")
    output.add_argument("--probe_share", type=float, default=0.05, help="--probe: the share of training tokens")
    output.add_argument("--probe_docs", type=int, default=256, help="--probe: documents each evaluation reads")
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
    output.add_argument("--async_checkpoint", type=str2bool, nargs="?", const=True, default=True,
                        help="write checkpoints in a background thread: a save stops training only to copy the state "
                             "to CPU memory (0 = write before training goes on; runs of several processes always do)")
    output.add_argument("--backup_dir", default=None,
                        help="also copy each checkpoint, in the background, to this fsspec URL (gs://bucket/dir, "
                             "s3://..., a local path); --keep_last applies there too, and --resume pulls from it "
                             "when the local directory is empty (default: off)")
    output.add_argument("--run", dest="wandb_run", metavar="RUN", default=os.environ.get("WANDB_RUN", "dummy"),
                        help="wandb run name ('dummy' = no wandb) (default: $WANDB_RUN, else dummy)")
    output.add_argument("--tensorboard", nargs="?", const="", default=None, metavar="DIR",
                        help="also log to TensorBoard, in DIR (default: off; DIR: <run dir>/tensorboard)")
    output.add_argument("--model_tag", type=model_tag_arg, default=None,
                        help="checkpoint directory name (default: d<depth>)")
    budget = p.add_argument_group("budgets (stop cleanly with a checkpoint when spent)")
    budget.add_argument("--max_hours", type=float, default=None,
                        help="wall-clock hours for the whole run (default: no limit)")
    budget.add_argument("--max_cost", type=float, default=None, help="dollars for the whole run (default: no limit)")
    budget.add_argument("--gpu_hourly_price", type=float, default=None,
                        help="dollars per GPU-hour, for cost reports (default: none, no costs)")
    resume = p.add_argument_group(
        "resume and preemption", "SIGTERM or SIGINT (Ctrl-C): every process finishes the step in progress, saves a "
        "checkpoint and exits with 128 + the signal number (143, 130); a second signal more than 5 s later exits at "
        "once. Allow one step plus one save: torchrun SIGKILLs its workers --shutdown-timeout seconds (default 30) "
        "after it forwards the signal.")
    resume.add_argument("--resume", type=str2bool, nargs="?", const=True, default=False,
                        help="continue from the latest loadable checkpoint of --model_tag")
    resume.add_argument("--resume_from_step", type=int, default=None,
                        help="continue from this checkpoint step (default: --resume's latest)")
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


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A training run, parsed and validated once: every flag of build_parser (device_type, dtype, compile, sharding,
    device_batch_size, total_batch_size and model_tag hold their settled values), then what follows from them."""
    # model
    depth: int
    n_embd: int | None
    n_head: int | None
    n_kv_head: int | None
    max_seq_len: int
    n_loops: int | None
    T_recursion: int | None
    n_sup_train: int | None
    n_sup_inference: int | None
    activation_fn: str | None
    state_update: str | None
    state_dtype: str | None
    sample_n_sup: bool | str | None
    detach_between_steps: bool | None
    backprop_steps: int | None
    activation_checkpointing: bool | None
    n_prelude: int | None
    n_coda: int | None
    halt_head: bool | None
    preset: str | None
    supervision_weight_base: float | None
    improvement_reward_scale: float | None
    consistency_weight: float | None
    # batch
    device_batch_size: int  # settled: the flag, or the largest the memory estimate fits
    total_batch_size: int  # settled: tokens per optimizer step
    gradient_accumulation_steps: int | None  # as given; grad_accum is the settled one
    rows: str  # settled: stream | documents (nanochat/data/dataloader.py)
    samples: bool  # greedy completions of SAMPLE_PROMPTS: off on a generated corpus, where English prompts mean nothing
    # horizon
    num_iterations: int | None
    target_flops: float | None
    target_param_data_ratio: float
    # optimisation
    matrix_lr: float
    embedding_lr: float
    unembedding_lr: float
    weight_decay: float
    grad_clip: float
    ema_decay: Any  # a decay in [0, 1), or "auto"
    warmup_steps: int | None
    warmup_ratio: float
    warmdown_ratio: float
    final_lr_frac: float
    n_sup_warmup: float
    # runtime
    device_type: str
    threads: int | None  # --threads: the CPU threads asked for (None: common.cpu_threads chooses)
    compile: bool
    compile_scope: str  # settled: layer or model (gpt.compile_scope_for)
    head_chunks: int | None  # settled: the training head's chunks per micro-batch, None = the default chunk
    diagnostics_every: int
    sharding: str  # settled: ddp or fsdp (sharding_requested may be auto)
    device_memory_gb: float | None
    peak_tflops: float | None
    dry_run: bool
    dtype: str
    attention: str  # auto | flash | cudnn | efficient | math (nanochat/train/attention.py)
    seed: int
    # evaluation and output
    eval_every: int
    probe: str  # none | hops (nanochat/train/probe.py)
    probe_share: float
    probe_docs: int
    eval_tokens: int
    early_stop: int
    sample_every: int
    sample_tokens: int
    save_every: int
    save_every_minutes: float
    keep_last: int
    async_checkpoint: bool
    backup_dir: str | None
    wandb_run: str  # --run: the wandb run's name, "dummy" for none
    tensorboard: str | None
    model_tag: str
    # budgets
    max_hours: float | None
    max_cost: float | None
    gpu_hourly_price: float | None
    # resume
    resume: bool
    resume_from_step: int | None
    overwrite: bool
    allow_data_change: bool
    # derived
    model_config: dict  # the GPTConfig fields, vocab_size aside (planning.resolve_model_config)
    config_sources: dict  # where each of them came from: a flag, the preset, gpt.py's default
    world_size: int  # processes
    sharding_requested: str  # --sharding as given: auto, ddp or fsdp
    plan_vocab_size: int  # the vocabulary the batch and memory are planned for
    argv: list  # the command line
    sharding_note: str = ""  # why `sharding`
    grad_accum: int | None = None  # micro-batches per optimizer step
    lr_scale: float = 1.0  # every learning rate's factor: sqrt(batch / B_REF) for the compute-optimal batch
    batch_notes: tuple = ()  # why the batch is what it is, one line each


def generated_corpus():
    """Whether the corpus is a generated one (python -m nanochat.dataset --synthetic), from its recorded source."""
    try:
        source = read_source(data_dir(create=False)) or ""
    except (OSError, ValueError, KeyError, TypeError):  # an unreadable manifest: the loader says what is wrong
        source = ""
    return source.startswith(SYNTHETIC)


def settle_rows(requested, generated):
    """--rows=auto: whole documents on a generated corpus, whose tokens mean nothing without their document's start (a
    hops table and its queries: rows cut mid-document kept the recursion at chance, dev/LOG.md issue 36); the stream
    on text, where every token trains."""
    if requested != "auto":
        return requested
    return "documents" if generated else "stream"


def given_flags(argv):
    """The flags named in argv, underscored and without values."""
    return {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}


def keep_resumed_recipe(meta, given, model_config, sources, n_sup_warmup):
    """A resumed run goes on with the recipe it was trained with, whatever gpt.py's and base_train's defaults are
    now: every model field left to gpt.py's default takes the checkpoint's value (model_config and sources updated in
    place; a field the checkpoint predates takes its old behaviour, GPTConfig.from_dict), and --n_sup_warmup, if not
    given, the checkpoint's (0, off, before it was recorded). Returns the run's n_sup_warmup."""
    saved = GPTConfig.from_dict(meta["model_config"]).to_dict()
    for name, source in sources.items():
        if source == "gpt.py default" and name in saved and saved[name] != model_config[name]:
            model_config[name], sources[name] = saved[name], f"checkpoint step {meta.get('step', '?')}"
    if "n_sup_warmup" in given:
        return n_sup_warmup
    return (meta.get("train_config") or {}).get("n_sup_warmup", 0.0)


def parse_args(argv=None, world_size=None, check_hardware=True, vocab_size=None, resumed_meta=None):
    """Parse and validate every flag without touching a model or data into a RunConfig; errors exit with what to
    change.

    vocab_size: the vocabulary the batch is planned for (default: the tokenizer's, or GPTConfig's before one exists).
    resumed_meta(model_tag, step): the meta.json a --resume continues (None when there is none); its recipe wins over
    the defaults (keep_resumed_recipe)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # torchrun ... -m scripts.base_train -- --depth=12
        argv = argv[1:]
    flags, unknown = parser.parse_known_args(argv)
    if unknown:
        reject_unknown(parser, unknown)
    world_size = world_size or get_dist_info()[3]
    if flags.preset is not None and flags.preset not in REFINEMENT_PRESETS:
        parser.error(f"unknown --preset={flags.preset}; valid presets: {', '.join(REFINEMENT_PRESETS)}")
    if flags.depth < 1:
        parser.error(f"--depth={flags.depth} must be >= 1")
    for name in ("n_embd", "n_head", "n_kv_head", "max_seq_len", "sample_tokens"):
        if getattr(flags, name) is not None and getattr(flags, name) < 1:
            parser.error(f"--{name}={getattr(flags, name)} must be >= 1")
    for name in ("eval_every", "early_stop", "sample_every", "save_every", "save_every_minutes", "keep_last",
                 "matrix_lr", "embedding_lr", "unembedding_lr", "weight_decay", "grad_clip", "gpu_hourly_price"):
        if getattr(flags, name) is not None and not getattr(flags, name) >= 0:
            parser.error(f"--{name}={getattr(flags, name)} must be >= 0 (see --help for what 0 means)")

    for name in ("target_flops", "target_param_data_ratio", "max_hours", "max_cost"):
        if getattr(flags, name) is not None and not getattr(flags, name) > 0:
            parser.error(f"--{name}={getattr(flags, name)} must be > 0")
    if not 0 < flags.probe_share < 1 or flags.probe_docs < 1:
        parser.error(f"--probe_share={flags.probe_share} must be between 0 and 1 and --probe_docs={flags.probe_docs} "
                     f">= 1")
    if flags.overwrite and (flags.resume or flags.resume_from_step is not None):
        parser.error("--overwrite starts over and --resume continues: give one of them")
    model_config, config_sources = resolve_model_config(flags.depth, flags.max_seq_len, flags.n_embd, flags.n_head,
                                                        flags.n_kv_head, flags.preset,
                                                        **{name: getattr(flags, name) for name in MODEL_FLAGS})
    meta = resumed_meta(flags.model_tag or f"d{flags.depth}", flags.resume_from_step) \
        if resumed_meta and (flags.resume or flags.resume_from_step is not None) else None
    if meta:
        flags.n_sup_warmup = keep_resumed_recipe(meta, given_flags(argv), model_config, config_sources,
                                                 flags.n_sup_warmup)
    try:
        GPTConfig(vocab_size=1, **model_config)
    except ValueError as e:
        shape = any(name in str(e) for name in ("n_embd", "n_head", "head dimension"))  # n_head covers n_kv_head
        parser.error(f"{e}" + (" (set --n_embd/--n_head/--n_kv_head or pick another --depth)" if shape else ""))
    device_type = flags.device_type or autodetect_device_type()
    if device_type not in ("cuda", "cpu", "mps"):
        parser.error(f"--device_type={device_type} is not one of cuda, cpu, mps")
    if check_hardware and not flags.dry_run and not device_available(device_type):
        parser.error(f"--device_type={device_type} is not available on this machine; "
                     f"use --device_type={autodetect_device_type()}")
    for name in ("device_batch_size", "gradient_accumulation_steps", "total_batch_size", "head_chunks",
                 "diagnostics_every", "threads"):
        if getattr(flags, name) is not None and getattr(flags, name) < 1:
            parser.error(f"--{name}={getattr(flags, name)} must be >= 1")
    for name in ("device_memory_gb", "peak_tflops"):
        if getattr(flags, name) is not None and not getattr(flags, name) > 0:
            parser.error(f"--{name}={getattr(flags, name)} must be > 0")
    if flags.sharding == "fsdp" and check_hardware and not flags.dry_run and not get_dist_info()[0]:
        parser.error("--sharding=fsdp needs a process group: launch with torchrun --standalone --nproc_per_node=N "
                     "-m scripts.base_train -- ... (N=1 works)")
    generated = generated_corpus()
    run_config = RunConfig(**{
        **vars(flags), "device_type": device_type, "dtype": flags.dtype or default_dtype(device_type),
        "compile": device_type == "cuda" if flags.compile is None else flags.compile,
        "model_tag": flags.model_tag or f"d{flags.depth}", "model_config": model_config,
        "config_sources": config_sources, "world_size": world_size,
        "sharding_requested": flags.sharding,  # auto is settled by the batch's memory budget (planning.plan_batch)
        "plan_vocab_size": vocab_size or tokenizer_vocab_size() or GPTConfig.vocab_size,  # tok_train's default too
        "rows": settle_rows(flags.rows, generated), "samples": not generated, "argv": argv})
    if run_config.model_config["state_dtype"] != "float32" and run_config.dtype == "float32":
        parser.error(f"--state_dtype={run_config.model_config['state_dtype']} needs autocast: add --dtype=bfloat16")
    try:
        run_config = plan_batch(run_config)
    except PlanError as e:
        parser.error(str(e))
    try:
        scope, _ = compile_scope_for(GPTConfig(vocab_size=1, **run_config.model_config), run_config.compile_scope,
                                     run_config.sharding == "fsdp")
    except ValueError as e:
        parser.error(f"--compile_scope: {e}")
    run_config = dataclasses.replace(run_config, compile_scope=scope)
    if run_config.sharding == "fsdp" and check_hardware and not run_config.dry_run:
        problem = host_ram_problem(GPTConfig(vocab_size=run_config.plan_vocab_size, **run_config.model_config))
        if problem:  # before anything is built: every rank would otherwise die swapping or OOM-killed mid-build
            parser.error(problem)
    if run_config.num_iterations is not None and run_config.num_iterations < 1:
        parser.error(f"--num_iterations={run_config.num_iterations} must be >= 1")
    if run_config.eval_tokens < run_config.max_seq_len:
        parser.error(f"--eval_tokens={run_config.eval_tokens} is less than one validation row (--max_seq_len="
                     f"{run_config.max_seq_len} tokens); raise it")
    if run_config.max_cost is not None and not run_config.gpu_hourly_price:
        parser.error("--max_cost needs --gpu_hourly_price to know what an hour costs")
    for name in ("warmup_ratio", "warmdown_ratio", "final_lr_frac", "n_sup_warmup"):
        if not 0 <= getattr(run_config, name) <= 1:
            parser.error(f"--{name}={getattr(run_config, name)} must be between 0 and 1")
    if run_config.warmup_steps is not None and run_config.warmup_steps < 0:
        parser.error(f"--warmup_steps={run_config.warmup_steps} must be >= 0")
    if run_config.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        parser.error(missing_package(ModuleNotFoundError(name="tensorboard"), "--tensorboard"))
    return run_config


def tokenizer_vocab_size():
    """The trained tokenizer's vocabulary size, or None when there is none yet (looked up without creating a dir)."""
    if not os.path.isdir(tokenizer_path()):
        return None
    return get_tokenizer().get_vocab_size()


def tokenizer_path():
    return os.path.join(get_base_dir(create=False), "tokenizer")


def data_problem():
    """None when the tokenizer and the training shards exist; else what is missing and the command that makes it."""
    tok_dir = tokenizer_path()
    if not os.path.isdir(tok_dir):
        return f"no tokenizer in {tok_dir}: train one first with python -m scripts.tok_train"
    try:
        parquets_for_split("train")
    except DatasetError as e:
        return str(e)
    return None


def batch_geometry(run_config):
    """What fixes the data of every step, recorded in each checkpoint and checked on resume."""
    return {"world_size": run_config.world_size, "device_batch_size": run_config.device_batch_size,
            "max_seq_len": run_config.max_seq_len, "grad_accum": run_config.grad_accum}


