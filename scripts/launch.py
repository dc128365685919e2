"""
The twelve scripts/train_<N>x<GPU>_<phase>.sh in one table-driven place: the guides' table, the plan, the preflight
checks, data and tokenizer, torchrun, and the success check after training.

    bash scripts/train_8xH100_fast.sh [base_train flags...]   # = python -m scripts.launch train 8xH100 fast [...]
    DRY_RUN=1 bash scripts/train_8xH100_fast.sh               # print the plan and the torchrun command, run nothing
    python -m scripts.launch check --model_tag=8xH100_fast --phase=fast   # success criteria (exit 1: not all met)
    python -m scripts.launch detect                            # this node's GPUs as a table row, e.g. 8xH100

Extra flags go to base_train after the table's, so they win. Environment overrides:
    DEPTH, NPROC (processes per node), DEVICE_TYPE        model depth, processes, cuda|cpu
    NANOCHAT_BASE_DIR, NANOCHAT_DATA_DIR                   where data, tokenizer and checkpoints live
    DATASET=builtin                                        the offline built-in corpus instead of FineWeb shards
    VOCAB_SIZE, TOK_MAX_CHARS                              the tokenizer trained when there is none
    NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT            multi-node: run the same script on every node; node 0
                                                           prepares data and tokenizer in the shared base directory
    NANOCHAT_NODE_WAIT_S                                   how long the other nodes wait for that (default 3 hours)
    DRY_RUN=1                                              plan and command only
    FORCE=1                                                go on past a failed preflight check (hardware, CUDA,
                                                           disk, memory)

Re-running a script continues its run: when the tag holds a compatible checkpoint the command gets --resume (the plan
says so). SIGTERM/SIGINT to this process is passed to torchrun, whose workers save a checkpoint and exit.
"""

import argparse
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys

import torch

from nanochat import checkpoint as ckpt
from nanochat.cli import ArgumentParser, Exit, ExitCode
from nanochat.common import gpu_peak_flops
from nanochat.data.dataset import data_dir, list_parquet_files
from nanochat.data.tokenizer import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, SPECIAL_TOKENS, get_tokenizer
from nanochat.eval.loss_eval import format_steps, step_name
from nanochat.eval.metrics import summary_path
from nanochat.files import free_bytes, get_base_dir, gigabytes
from nanochat.model.gpt import GPTConfig
from nanochat.train import lifecycle, memory, multinode, preflight
from nanochat.train.config import batch_geometry, parse_args
from nanochat.train.flops import estimate_flops, planned_depth
from nanochat.train.planning import (
    PLANNER_MFU,
    budget_lines,
    drawn_note,
    fit_device_batch,
    free_ram_per_process,
    keeps_ema,
    memory_need,
    meta_model,
    model_config,
    settle_sharding,
    sharding_lines,
    step_seconds,
    time_note,
)

# The device each GPU model of the table means (its name as torch reports it): the nodes are 8-GPU SXM boards.
LAUNCH_TABLE_DEVICES = {"H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200", "B200": "NVIDIA B200",
                        "A100": "NVIDIA A100-SXM4-80GB"}
# The guides' table: GPUs per node, GPU model, its memory (GB), the node's $/hour, and per phase the device batch,
# gradient accumulation and the guide's seconds per step (low, high).
HARDWARE = {
    "8xB200": dict(gpus=8, gpu="B200", gb=180, price=50.00, fast=(40, 2, (0.3, 0.5)), extreme=(20, 2, (0.5, 1.0))),
    "8xH200": dict(gpus=8, gpu="H200", gb=141, price=36.32, fast=(36, 2, (0.4, 0.6)), extreme=(18, 2, (0.8, 1.2))),
    "8xH100": dict(gpus=8, gpu="H100", gb=80, price=31.60, fast=(32, 2, (0.5, 1.0)), extreme=(16, 2, (1.0, 2.0))),
    "8xA100": dict(gpus=8, gpu="A100", gb=80, price=20.00, fast=(28, 2, (0.7, 1.0)), extreme=(14, 2, (1.5, 2.0))),
    "4xH100": dict(gpus=4, gpu="H100", gb=80, price=15.80, fast=(32, 4, (0.8, 1.2)), extreme=(16, 4, (1.5, 2.5))),
    "4xA100": dict(gpus=4, gpu="A100", gb=80, price=10.00, fast=(28, 4, (1.0, 1.5)), extreme=(14, 4, (2.0, 3.0))),
}
PHASES = {
    "fast": dict(title="Phase 1 (fast)", iterations=1000, preset="aggressive", matrix_lr=0.001, embedding_lr=0.01,
                 shards=50, tok_chars=500_000_000, refinement=(15, 25), grad_norm=(0.5, 1.5)),
    "extreme": dict(title="Phase 2 (extreme)", iterations=5000, preset="extreme", matrix_lr=0.0005,
                    embedding_lr=0.005, shards=100, tok_chars=1_000_000_000, refinement=(50, 97), grad_norm=(2, 15)),
}
SHARD_BYTES = 100e6  # one FineWeb-Edu parquet shard is about 100 MB on disk


def env(name, default=None):
    value = os.environ.get(name, "")
    return value if value != "" else default


def env_flag(name):
    return env(name, "0") != "0"  # as the bash side reads it: set and not 0


def env_int(name, default, low=1, high=None, why=""):
    value = env(name, default)
    if not str(value).isdigit() or int(value) < low or (high is not None and int(value) > high):
        bounds = f"from {low} to {high}" if high is not None else f">= {low}"
        raise Exit(f"{name}={value!r} must be an integer {bounds}{why}", code=ExitCode.USAGE)
    return int(value)


def processes(key):
    """(processes per node, nodes)."""
    return env_int("NPROC", HARDWARE[key]["gpus"]), env_int("NNODES", 1)


# ---------------------------------------------------------------------------------------------------- hardware
def detect_gpus():
    """[(name, memory bytes)] of this machine's GPUs: nvidia-smi, else torch, else none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [(name.strip(), int(float(mib)) * 2**20) for name, mib in
                (line.rsplit(",", 1) for line in out.strip().splitlines() if line.strip())]
    except (OSError, subprocess.SubprocessError, ValueError):
        return [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
                for i in range(torch.cuda.device_count())]


def gpu_model(name):
    """The table's GPU model in a device name ('NVIDIA H100 80GB HBM3' -> 'H100'), or None."""
    return next((hw["gpu"] for hw in HARDWARE.values() if hw["gpu"] in name), None)


def hardware_key(gpus):
    """The table row for a list of detected GPUs ('8xH100'), or None."""
    models = {gpu_model(name) for name, _ in gpus}
    key = f"{len(gpus)}x{models.pop()}" if len(models) == 1 and None not in models else None
    return key if key in HARDWARE else None


def describe(gpus):
    return f"{len(gpus)}x {gpus[0][0]} ({gpus[0][1] / 1e9:.0f} GB)" if gpus else "no GPU"


# ---------------------------------------------------------------------------------------------------- the command
def user_flag_names(extra):
    return {arg[2:].split("=", 1)[0] for arg in extra if arg.startswith("--")}


def torchrun_prefix(nproc, nnodes):
    if nnodes == 1:
        return ["torchrun", "--standalone", f"--nproc_per_node={nproc}"]
    missing = [name for name in ("NODE_RANK", "MASTER_ADDR") if env(name) is None]
    if missing:
        raise Exit(f"NNODES={nnodes} also needs {' and '.join(missing)}: set NODE_RANK=0..{nnodes - 1} (0 on the node "
                   f"at MASTER_ADDR) and MASTER_ADDR=<address of node 0 reachable from every node>",
                   code=ExitCode.USAGE)
    node_rank = env_int("NODE_RANK", None, low=0, high=nnodes - 1, why=f" (this node's index of NNODES={nnodes})")
    port = env_int("MASTER_PORT", 29500, high=65535, why=" (a TCP port free on node 0)")
    return ["torchrun", f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--master_addr={env('MASTER_ADDR')}",
            f"--master_port={port}", f"--nproc_per_node={nproc}"]


def fit_batch(row, phase, world, given, argv, vocab_size, memory_bytes):
    """Device batch, accumulation and checkpointing that fit memory and keep the table's effective batch.

    argv: the table's flags (minus those the user gives) + the user's. Returns (flags to add, the plan's lines on
    what changed and why); flags the user passed are left as they are.
    """
    batch, accum, _ = row[phase]
    sequences = row["gpus"] * batch * accum  # the table's effective batch, in sequences per optimizer step
    if given & {"gradient_accumulation_steps", "total_batch_size"}:
        return {}, ["changed: batch geometry set by your flags: the table's effective batch is not enforced"]
    if sequences % world:
        raise Exit(f"the table's effective batch of {sequences} sequences does not split over {world} processes; "
                   f"pass --device_batch_size and --gradient_accumulation_steps yourself", code=ExitCode.USAGE)
    per_rank = sequences // world
    run_config = parse_args(argv, world_size=world, check_hardware=False, vocab_size=vocab_size)
    if "device_batch_size" in given:
        b = run_config.device_batch_size
        if per_rank % b:
            raise Exit(f"--device_batch_size={b} does not divide the {per_rank} sequences each process needs per step "
                       f"(the table's {sequences} over {world} processes); pick a divisor of {per_rank}",
                       code=ExitCode.USAGE)
        return {"gradient_accumulation_steps": per_rank // b}, [
            f"changed: accumulation {accum} -> {per_rank // b} keeps the table's {sequences} sequences at your device "
            f"batch {b}"]
    config = model_config(run_config, vocab_size)
    b, why, run_config = fit_for_budget(run_config, vocab_size, per_rank, memory_bytes, max_batch=batch,
                                        allow_checkpointing="activation_checkpointing" not in given)
    if b is None:
        raise Exit(f"{why} (with activation checkpointing); lower DEPTH, --max_seq_len or --n_sup_train",
                   code=ExitCode.USAGE)
    flags = {"device_batch_size": b, "gradient_accumulation_steps": per_rank // b}
    notes = [f"changed: {run_config.sharding_note}"]
    if run_config.sharding_requested == "auto":  # settled for the launcher's budget, not for this machine's
        flags["sharding"] = run_config.sharding
    if run_config.model_config["activation_checkpointing"] and not config.activation_checkpointing:
        flags["activation_checkpointing"] = "true"
        need = memory_need(run_config, batch, config=config)
        notes.append(f"changed: activation checkpointing turned ON: the table's batch {batch} would need "
                     f"~{need / 1e9:,.0f} GB per device without it, {memory.usable_bytes(memory_bytes) / 1e9:.0f} GB "
                     f"are usable")
    if (b, per_rank // b) != (batch, accum):
        notes.append(f"changed: device batch {batch} -> {b} and accumulation {accum} -> {per_rank // b}: the "
                     f"batch that fits and trains fastest (fit: below), and {world} processes x {b} x {per_rank // b} "
                     f"= {sequences} sequences keeps the table's effective batch ({row['gpus']} x {batch} x {accum})")
    notes.append(f"fit:     {why}")  # and why more accumulation or recomputation, by the planned time
    return flags, notes


def fit_for_budget(run_config, vocab_size, sequences_per_rank, memory_bytes, **fit):
    """planning.fit_device_batch at the launcher's vocabulary and memory budget, --sharding=auto settled for that
    budget (not for this machine's memory, which parse_args settled it for)."""
    memory_at = (memory_bytes, "the launcher's budget")
    run_config = settle_sharding(dataclasses.replace(run_config, plan_vocab_size=vocab_size), memory_at)
    return fit_device_batch(run_config, sequences_per_rank, memory_at=memory_at, **fit)


def compose(key, phase, extra, vocab_size, memory_bytes):
    """(torchrun command, base_train's RunConfig, notes): the table's flags, the memory fit, then the user's."""
    row, ph = HARDWARE[key], PHASES[phase]
    nproc, nnodes = processes(key)
    prefix = torchrun_prefix(nproc, nnodes)  # checks the multi-node environment before anything is computed
    tag = f"{key}_{phase}"
    table = {"depth": env("DEPTH", 12), "n_loops": 2, "preset": ph["preset"], "matrix_lr": ph["matrix_lr"],
             "embedding_lr": ph["embedding_lr"], "num_iterations": ph["iterations"],
             "device_batch_size": row[phase][0], "gradient_accumulation_steps": row[phase][1],
             "compile": "true", "dtype": "bfloat16", "grad_clip": 1.0, "save_every": 200, "eval_every": 100,
             "sample_every": 100, "device_type": env("DEVICE_TYPE", "cuda"), "run": tag, "model_tag": tag,
             "gpu_hourly_price": round(row["price"] / row["gpus"], 4)}  # base_train counts $ per GPU-hour
    given = user_flag_names(extra)
    if "total_batch_size" in given:  # it implies the accumulation; giving both would contradict
        given.add("gradient_accumulation_steps")
    as_flags = lambda d: [f"--{k}={v}" for k, v in d.items()]
    table = {k: v for k, v in table.items() if k not in given}  # the user's flag wins, and is printed once
    fitted, notes = fit_batch(row, phase, nproc * nnodes, given, as_flags(table) + extra, vocab_size, memory_bytes)
    argv = as_flags({**table, **fitted}) + list(extra)
    # base_train's own validation
    run_config = parse_args(argv, world_size=nproc * nnodes, check_hardware=False, vocab_size=vocab_size)
    return prefix + ["-m", "scripts.base_train", "--"] + argv, run_config, notes


# ---------------------------------------------------------------------------------------------------- preflight
def hardware_problem(key, phase, gpus):
    """None when this node has the GPUs the script is for, else what is wrong and the fix."""
    row = HARDWARE[key]
    nproc = processes(key)[0]
    enough = len(gpus) >= nproc if env("NPROC") else len(gpus) == nproc
    if enough and all(gpu_model(name) == row["gpu"] for name, _ in gpus):
        return None
    wanted = f"{nproc}x {row['gpu']}"
    if not gpus:
        return (f"no GPU found (neither nvidia-smi nor torch sees one); this script is for {wanted}. On a GPU node "
                f"check the driver with nvidia-smi; to run on CPU set DEVICE_TYPE=cpu; FORCE=1 skips this check.")
    found = hardware_key(gpus)
    fix = (f"run scripts/train_{found}_{phase}.sh instead" if found else
           f"no script matches it: NPROC={len(gpus)} FORCE=1 bash scripts/train_{key}_{phase}.sh runs this recipe "
           f"on it (the effective batch is kept by more accumulation)")
    return f"found {describe(gpus)}, this script is for {wanted}: {fix}"


def memory_budget(key, device_type, gpus, nproc):
    """(bytes per device, where the number comes from)."""
    if device_type != "cuda":
        return free_ram_per_process(nproc)
    if gpus:
        return min(b for _, b in gpus), f"{gpus[0][0]}, detected"
    gb = HARDWARE[key]["gb"]
    return int(gb * 1e9), f"{HARDWARE[key]['gpu']} nominal {gb} GB, no GPU detected"


def data_status(phase):
    """(shard files needed, present, data dir) for this phase; DATASET=builtin needs the built-in corpus only."""
    needed = 2 if env("DATASET") == "builtin" else PHASES[phase]["shards"] + 1  # + the validation shard
    return needed, len(list_parquet_files()), data_dir()


def disk_problem(needed, present, directory):
    missing = 0 if env("DATASET") == "builtin" else max(0, needed - present)
    free = free_bytes(directory)
    if missing * SHARD_BYTES > free:
        return (f"{missing} shards to download need ~{missing * SHARD_BYTES / 1e9:.0f} GB, {directory} has "
                f"{free / 1e9:.0f} GB free: free space or point NANOCHAT_DATA_DIR at a bigger disk")
    return None


def run_state(run_config, vocab, have_tokenizer, given, model):
    """(flags to add, plan lines, preflight problems) for what the tag already holds: a re-run continues a
    compatible checkpoint with --resume, and the checkpoints to come must fit on the disk."""
    tag, flags, lines, problems = run_config.model_tag, [], [], []
    per_checkpoint = ckpt.checkpoint_bytes(model)
    copies = run_config.keep_last + 2 if run_config.keep_last else "all"
    lines.append(f"checkpoints  ~{gigabytes(per_checkpoint)} each, every {run_config.save_every} steps and "
                 f"{run_config.save_every_minutes:g} min, keeping {copies} (--keep_last={run_config.keep_last}, the "
                 f"best, one being written) in {ckpt.model_dir(tag)}; "
                 f"{gigabytes(free_bytes(ckpt.model_dir(tag)))} free")
    room = ckpt.disk_room_problem(tag, per_checkpoint, run_config.keep_last)
    problems += [room] if room else []
    steps, found = ckpt.list_steps(tag), ckpt.previous_run(tag)
    if given & {"resume", "resume_from_step", "overwrite"}:
        asked = ", ".join(sorted(given & {"resume", "resume_from_step", "overwrite"}))
        lines.append(f"resume       as your flags say ({asked})")
    elif steps:
        metas = [m for m in map(lambda s: readable_meta(tag, s), reversed(steps)) if m]
        config = {**run_config.model_config, "vocab_size": vocab}
        diffs = ckpt.resume_differences(metas[0], config, batch_geometry(run_config)) if metas else \
            ["no readable meta.json"]
        saved_tok = metas[0].get("tokenizer_fingerprint") if metas else None
        if have_tokenizer and saved_tok and saved_tok != tokenizer_fingerprint():
            diffs.append(f"tokenizer: checkpoint {saved_tok} vs {tokenizer_fingerprint()} in the tokenizer directory")
        elif not have_tokenizer:
            diffs.append("tokenizer: the checkpoints' tokenizer is missing (a new one would give ids other meanings)")
        if diffs:
            problems.append(f"{tag} holds checkpoints (steps {', '.join(map(str, steps))}) of a different run: "
                            f"{'; '.join(diffs)}. Pass the flags it was trained with, a new --model_tag, or "
                            f"--overwrite to start over (the old run is moved aside, nothing is deleted)")
        else:
            flags.append("--resume")
            lines.append(f"resume       {tag} has checkpoints up to step {steps[-1]}: continuing from the newest "
                         f"loadable one (--resume); --overwrite starts over instead")
    elif found:
        flags.append("--overwrite")
        lines.append(f"resume       {tag} holds an attempt that saved no checkpoint ({found}): starting over, its "
                     f"files are moved to {tag}.replaced-<date>/ (--overwrite)")
    elif run_config.backup_dir and backup_steps(run_config.backup_dir, tag, problems):
        flags.append("--resume")
        lines.append(f"resume       no local checkpoint; continuing from the backup {run_config.backup_dir} "
                     f"(--resume)")
    else:
        lines.append(f"resume       no checkpoint of {tag}: a new run")
    return flags, lines, problems


def backup_steps(url, tag, problems):
    """The steps the backup holds; an unreadable backup URL becomes a preflight problem."""
    try:
        return ckpt.Backup.location(url, tag).steps()
    except ckpt.CheckpointError as e:
        problems.append(str(e))
        return []


def readable_meta(tag, step):
    try:
        return ckpt.read_meta(tag, step)
    except ckpt.CheckpointError:
        return None


def tokenizer_fingerprint():
    return get_tokenizer().fingerprint()


def tokenizer_vocab():
    """The existing tokenizer's vocab size, or None when there is no tokenizer yet."""
    try:
        return get_tokenizer().get_vocab_size()
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------- the plan
def hours(seconds):
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def print_plan(key, phase, cmd, run_config, notes, gpus, budget, problems, vocab, have_tokenizer, data, state_lines):
    row, ph = HARDWARE[key], PHASES[phase]
    nproc, nnodes = processes(key)
    world = nproc * nnodes
    config = model_config(run_config, vocab)
    sequences = world * run_config.device_batch_size * run_config.grad_accum
    table_sequences = row["gpus"] * row[phase][0] * row[phase][1]
    est = memory.estimate_memory(config, run_config.device_batch_size, run_config.dtype, world,
                                 keeps_ema(run_config.ema_decay, run_config.num_iterations), run_config.sharding)
    model = meta_model(config)
    iterations = run_config.num_iterations or ph["iterations"]
    depth = planned_depth(config, run_config.n_sup_warmup, iterations)  # the mean supervision steps drawn
    model_flops = estimate_flops(model, n_sup=depth)
    recompute = memory.recompute_share(config) * model_flops if config.activation_checkpointing else 0
    step_flops = model_flops * run_config.total_batch_size
    peak = gpu_peak_flops(LAUNCH_TABLE_DEVICES[row["gpu"]]) if run_config.device_type == "cuda" else None
    warmup = run_config.warmup_steps if run_config.warmup_steps is not None else \
        round(run_config.warmup_ratio * iterations)
    src = run_config.config_sources
    out = [f"=== {ph['title']} on {key}: scripts/train_{key}_{phase}.sh ===",
           f"hardware     script for {row['gpus']}x {row['gpu']} ({row['gb']} GB), {nnodes} node(s) x {nproc} "
           f"processes, device {run_config.device_type}; found: "
           f"{describe(gpus) if run_config.device_type == 'cuda' else 'GPU check skipped (not cuda)'}",
           f"model        depth {config.n_layer}, width {config.n_embd}, {config.n_head} heads, n_loops "
           f"{config.n_loops}, {config.n_sup_train} supervision steps, T_recursion {config.T_recursion}, vocab "
           f"{vocab:,}{'' if have_tokenizer else ' (tokenizer to be trained)'}: "
           f"{model.num_params():,} parameters",
           f"refinement   supervision_weight_base={config.supervision_weight_base} "
           f"({src['supervision_weight_base']}), improvement_reward_scale={config.improvement_reward_scale} "
           f"({src['improvement_reward_scale']}). The script passes --preset={run_config.preset}, so the guides' edit "
           f"of nanochat/model/gpt.py is not needed; gpt.py's defaults (now {GPTConfig.supervision_weight_base}, "
           f"{GPTConfig.improvement_reward_scale}) apply to base_train runs without --preset or these flags.",
           f"batch        table: {row['gpus']} GPUs x {row[phase][0]} x {row[phase][1]} accumulation = "
           f"{table_sequences} sequences",
           f"             run:   {world} processes x {run_config.device_batch_size} x {run_config.grad_accum} "
           f"accumulation = {sequences} sequences x {run_config.max_seq_len} tokens = "
           f"{run_config.total_batch_size:,} tokens per step"
           + ("" if sequences == table_sequences else "  (DIFFERS from the table)"),
           *[f"             {note}" for note in notes],
           f"memory       ~{est['total'] / 1e9:.1f} GB per device at batch {run_config.device_batch_size}"
           f"{' with activation checkpointing' if config.activation_checkpointing else ''} (nanochat/train/memory.py: "
           f"{run_config.sharding}: params+grads+optimizer "
           f"{(est['params'] + est['grads'] + est['optimizer']) / 1e9:.1f}"
           + (f", gathered {est['gathered'] / 1e9:.1f}" if "gathered" in est else "") + ", activations "
           f"{est['activations'] / 1e9:.1f}, logits {est['logits'] / 1e9:.1f}, transient {est['transient'] / 1e9:.1f}"
           + (f", evaluation beyond training {est['evaluation'] / 1e9:.1f}" if est.get("evaluation") else "") + ")"
           f"; usable {memory.usable_bytes(budget[0]) / 1e9:.0f} GB ({budget[1]})"
           + ("; eager-mode counts: compiled (--compile, on here) fuses ops and saves fewer activations, so it needs "
              "less" if run_config.compile else ""),
           *sharding_lines(run_config, config, budget[0]),
           f"schedule     {iterations} steps, matrix_lr {run_config.matrix_lr}, embedding_lr "
           f"{run_config.embedding_lr}, warmup {warmup} steps, grad clip {run_config.grad_clip}, eval every "
           f"{run_config.eval_every}, samples "
           f"every {run_config.sample_every}, checkpoint every {run_config.save_every}, compile {run_config.compile}, "
           f"{run_config.dtype}",
           f"compute      {model_flops:.3e} FLOPs per token (train/flops.py: every loop, sweep and supervision "
           f"step{drawn_note(config, depth)}) x {run_config.total_batch_size:,} tokens = {step_flops:.3e} FLOPs "
           f"per step"
           + (f", + {recompute * run_config.total_batch_size:.3e} recomputed by checkpointing" if recompute else "")]
    if peak:
        seconds = step_seconds(run_config, model, peak, iterations)
        lo, hi = row[phase][2]
        cost = seconds * iterations / 3600 * row["price"] * nnodes
        out += [f"time         peak {peak / 1e12:,.0f} TFLOP/s bf16 per GPU, assuming {PLANNER_MFU:.0%} MFU"
                f"{time_note(run_config, config)}: "
                f"{seconds:.2f} s/step, {iterations} steps = {hours(seconds * iterations)}; the guide says "
                f"{lo}-{hi} s/step = {hours(lo * iterations)}-{hours(hi * iterations)}",
                f"cost         ${row['price']:.2f}/hour per node x {nnodes} x {hours(seconds * iterations)} = "
                f"${cost:,.0f} (guide's figure: ${lo * iterations / 3600 * row['price']:,.0f}-"
                f"${hi * iterations / 3600 * row['price']:,.0f} on one node)",
                *budget_lines(run_config.max_hours, run_config.total_batch_size, seconds, iterations)]
        if seconds > 2 * hi or seconds < lo / 2:
            out.append(f"WARNING      the guide's {lo}-{hi} s/step and the FLOPs-based {seconds:.2f} s/step disagree "
                       f"by more than 2x: budget with the FLOPs-based figure and watch the measured dt in the log "
                       f"(--max_cost / --max_hours stop a run cleanly)")
    needed, present, directory = data
    out += [f"data         {directory}: {present} shard files present, {needed} needed"
            + ("" if present >= needed else (" -> build the built-in corpus" if env("DATASET") == "builtin" else
                                              f" -> download {needed - 1} FineWeb shards (+ validation)")),
            "tokenizer    " + ("present" if have_tokenizer else
                               f"missing -> train on {tok_chars(phase):,} chars, vocab {vocab:,}"),
            *state_lines,
            *[f"PREFLIGHT    {p}" for p in problems],
            f"command      {shlex.join(cmd)}"]
    print("\n".join(out), flush=True)


def tok_chars(phase):
    return env_int("TOK_MAX_CHARS", PHASES[phase]["tok_chars"])


# ---------------------------------------------------------------------------------------------------- after training
# The refinement this project has measured on text, beside the guides' promise (PHASES[...]["refinement"]): the guides'
# figures were never reproduced, so they are reported, not enforced (dev/LOG.md, "Does refinement pay?").
MEASURED_REFINEMENT = "about 1% on held-out text at CPU scale (dev/LOG.md)"


def check_criteria(summary, phase):
    """[(status, line)] for a finished run: status True/False for what gates the next phase, None for what is only
    reported. The gate is what predicts a wasted Phase 2: no finite validation result, later supervision steps that do
    not beat the first (Phase 2 only raises their weight), or a non-finite gradient norm. The guides' refinement and
    gradient-norm ranges are printed beside the measurement, not enforced."""
    ph = PHASES[phase]
    bpb = summary.get("val_bpb")
    results = []
    if bpb and all(math.isfinite(b) for b in bpb):
        order = format_steps(bpb, names=True)
        results.append((bpb[-1] < bpb[0], f"the later supervision steps beat the first (val bpb): {order}"))
        ordered = all(a > b for a, b in zip(bpb, bpb[1:]))
        results.append((None, f"supervision order: {'each' if ordered else 'not every'} step beats the one before"))
        refinement = 100 * summary["val_refinement"]
        lo, hi = ph["refinement"]
        results.append((None, f"refinement {refinement:.1f}% (the guides promise {lo}-{hi}%; this project measured "
                              f"{MEASURED_REFINEMENT})"))
    else:
        results.append((False, f"no finite validation result in summary.json (val bpb {bpb})"))
    g = summary.get("grad_norm_median_last")
    lo, hi = ph["grad_norm"]
    results.append((g is not None and math.isfinite(g), f"gradient norm, median of the last 10% of steps: "
                    f"{g if g is None else f'{g:.3f}'} (the guides expect {lo}-{hi})"))
    return results


def status_label(status):
    return {True: "met", False: "NOT MET", None: "info"}[status]


def read_summary(model_tag):
    path = summary_path(os.path.join(get_base_dir(), "base_checkpoints", model_tag))
    if not os.path.exists(path):
        raise Exit(f"no {path}: the run {model_tag} has not finished (train it with its scripts/train_*.sh)",
                   code=ExitCode.FAILED)
    with open(path) as f:
        return json.load(f)


def criteria_report(model_tag, phase):
    """(text, all met) for a finished run."""
    summary = read_summary(model_tag)
    results = check_criteria(summary, phase)
    losses = summary.get("train_step_losses") or []
    lines = [f"=== {PHASES[phase]['title']} results: {model_tag} (step {summary['step']}) ===",
             "final train loss per supervision step: "
             + ", ".join(f"{step_name(s)} {l:.4f}" for s, l in enumerate(losses)),
             *[f"[{status_label(status)}] {text}" for status, text in results]]
    all_met = all(status is not False for status, _ in results)
    if phase == "fast":
        key = model_tag.rsplit("_", 1)[0]
        nxt = f"bash scripts/train_{key}_extreme.sh" if key in HARDWARE else "the matching scripts/train_*_extreme.sh"
        lines.append(f"next: {nxt}   (Phase 2; it passes --preset=extreme itself)" if all_met else
                     f"a criterion is NOT MET: Phase 2 would be wasted; see docs/troubleshooting.md before Phase 2 "
                     f"({nxt})")
    return "\n".join(lines), all_met


# ---------------------------------------------------------------------------------------------------- commands
def run(cmd):
    """Run a step with signals passed on (lifecycle.run_child): the step stops cleanly (base_train saves a
    checkpoint), then so does the script, with 128 + the signal number."""
    rc, received = lifecycle.run_child(cmd)
    if received:
        raise Exit(f"stopped by {received.name} during {shlex.join(cmd[:4])} ...; run the same command again to "
                   f"continue where it stopped", code=ExitCode.SIGNALED + received.value)
    if rc:
        raise Exit(f"{shlex.join(cmd[:4])} ... failed with exit code {rc}", code=rc)


def train(key, phase, extra):
    nproc = processes(key)[0]
    device_type = env("DEVICE_TYPE", "cuda")
    if env("DATASET", "fineweb") not in ("fineweb", "builtin"):
        raise Exit(f"DATASET={env('DATASET')!r}: use fineweb (the default) or builtin", code=ExitCode.USAGE)
    gpus = detect_gpus() if device_type == "cuda" else []
    vocab = tokenizer_vocab()
    have_tokenizer = vocab is not None
    vocab = vocab or env_int("VOCAB_SIZE", GPTConfig.vocab_size, low=MIN_VOCAB_SIZE, high=MAX_VOCAB_SIZE,
                             why=f" (256 byte tokens + {len(SPECIAL_TOKENS)} special tokens at least; "
                                 f"default {GPTConfig.vocab_size})")
    budget = memory_budget(key, device_type, gpus, nproc)
    cmd, run_config, notes = compose(key, phase, extra, vocab, budget[0])
    data = data_status(phase)
    problems = [p for p in (hardware_problem(key, phase, gpus) if run_config.device_type == "cuda" else None,
                            disk_problem(*data)) if p]
    need = memory_need(run_config, run_config.device_batch_size, config=model_config(run_config, vocab))
    if need > memory.usable_bytes(budget[0]):
        problems.append(oom_problem(run_config, vocab, budget[0], need))
    flags, state_lines, state_problems = run_state(run_config, vocab, have_tokenizer, user_flag_names(extra),
                                                   meta_model(model_config(run_config, vocab)))
    cmd, problems = cmd + flags, problems + state_problems
    print_plan(key, phase, cmd, run_config, notes, gpus, budget, problems, vocab, have_tokenizer, data, state_lines)
    # DRY_RUN runs the in-process checks (seconds) and leaves out the compile check (a minute)
    stack = preflight.cuda_problems(run_config.device_type,
                                    compile_check=run_config.compile and not env_flag("DRY_RUN"))
    print("".join(f"PREFLIGHT    {p}\n" for p in stack), end="", flush=True)
    problems += stack
    if env_flag("DRY_RUN"):
        print("DRY_RUN=1: nothing was run" + (" (the preflight above would stop a real run)" if problems else ""))
        return 0
    if problems and not env_flag("FORCE"):
        raise Exit("preflight failed, nothing was run or downloaded:\n  " + "\n  ".join(problems) +
                   "\nFix it as above, or set FORCE=1 to go on anyway.", code=ExitCode.USAGE)
    nnodes, prepared = processes(key)[1], {"dataset": env("DATASET", "fineweb"), "shards": PHASES[phase]["shards"]}
    waited = multinode.prepare_on_node0(lambda: prepare(phase, data, have_tokenizer, vocab), prepared, nnodes,
                                        env_int("NODE_RANK", 0, low=0),
                                        env_int(multinode.WAIT_ENV, multinode.DEFAULT_WAIT_S),
                                        probe_s=env_int(multinode.PROBE_ENV, multinode.DEFAULT_PROBE_S))
    if waited:
        raise Exit(waited, code=ExitCode.FAILED)
    run(cmd)
    if env("NODE_RANK", "0") == "0":  # node 0 ran rank 0, which wrote the summary
        print(criteria_report(run_config.model_tag, phase)[0])
    return 0


def prepare(phase, data, have_tokenizer, vocab):
    """The data and the tokenizer the run needs, where missing."""
    needed, present, _ = data
    if env("DATASET") == "builtin":
        run([sys.executable, "-m", "nanochat.data.dataset", "--builtin"])
    elif present < needed:
        run([sys.executable, "-m", "nanochat.data.dataset", "-n", str(PHASES[phase]["shards"])])
    if not have_tokenizer:
        run([sys.executable, "-m", "scripts.tok_train", f"--max_chars={tok_chars(phase)}", f"--vocab_size={vocab}"])


def oom_problem(run_config, vocab, budget, need):
    per_rank = run_config.device_batch_size * run_config.grad_accum
    # trial: run_config as the fit leaves it, activation checkpointing maybe turned on
    batch, _, trial = fit_for_budget(run_config, vocab, per_rank, budget, max_batch=run_config.device_batch_size,
                                     allow_checkpointing=True)
    checkpointing = (trial.model_config["activation_checkpointing"]
                     and not run_config.model_config["activation_checkpointing"])
    fix = ("lower DEPTH or --max_seq_len" if batch is None else
           f"use --device_batch_size={batch} --gradient_accumulation_steps={per_rank // batch}"
           + (" --activation_checkpointing" if checkpointing else "") + " (same effective batch)")
    return (f"predicted out of memory: ~{need / 1e9:.0f} GB per device at "
            f"--device_batch_size={run_config.device_batch_size}, {memory.usable_bytes(budget) / 1e9:.0f} GB usable: "
            f"{fix}")


def detect(gpus_wanted):
    """Print this node's table row (e.g. 8xH100); HARDWARE=8xA100 overrides, DRY_RUN falls back to 8xH100."""
    key = env("HARDWARE") or hardware_key(detect_gpus())
    if key is None and env_flag("DRY_RUN"):
        print(f"no {gpus_wanted}-GPU node of the table found; DRY_RUN shows 8xH100 (set HARDWARE= to pick)",
              file=sys.stderr)
        key = "8xH100"
    if key not in HARDWARE or HARDWARE[key]["gpus"] != gpus_wanted:
        rows = ", ".join(k for k, v in HARDWARE.items() if v["gpus"] == gpus_wanted)
        raise Exit(f"found {key or describe(detect_gpus())}; this needs one of {rows} (HARDWARE= overrides the "
                   f"detection); for other hardware use the scripts/train_*.sh with NPROC=", code=ExitCode.FAILED)
    print(key)
    return 0


def report(runs, out_path):
    """The speedrun's report: each run's report.md and its success criteria, in one file."""
    parts = []
    for run_spec in runs:
        tag, phase = run_spec.split(":")
        text, _ = criteria_report(tag, phase)
        with open(os.path.join(get_base_dir(), "base_checkpoints", tag, "report.md")) as f:
            parts += [f.read(), "```", text, "```", ""]
    with open(out_path, "w") as f:
        f.write("\n".join(parts))
    print(f"report: {out_path}")
    return 0


def main(argv=None):
    parser = ArgumentParser(prog="python -m scripts.launch", allow_abbrev=False,
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="plan, preflight, data, tokenizer, torchrun, success check")
    p.add_argument("hardware", choices=HARDWARE)
    p.add_argument("phase", choices=PHASES)
    p = sub.add_parser("check", help="success criteria of a finished run (exit 1 when not all met)")
    p.add_argument("--model_tag", required=True)
    p.add_argument("--phase", choices=PHASES, required=True)
    p = sub.add_parser("detect", help="print this node's row of the table")
    p.add_argument("--gpus", type=int, default=8)
    p = sub.add_parser("report", help="collect runs' reports and criteria into one file")
    p.add_argument("runs", nargs="+", metavar="MODEL_TAG:PHASE")
    p.add_argument("--out", required=True)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "train":
            return train(args.hardware, args.phase, extra)
        if args.command == "check":
            text, all_met = criteria_report(args.model_tag, args.phase)
            print(text)
            return ExitCode.OK if all_met else ExitCode.FAILED
        if args.command == "detect":
            return detect(args.gpus)
        return report(args.runs, args.out)
    except Exit as e:
        print(f"launch: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("launch: interrupted", file=sys.stderr, flush=True)
        return ExitCode.SIGNALED + signal.SIGINT
    except SystemExit as e:  # base_train's parse_args rejected a flag: its message says which
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
            return ExitCode.USAGE
        raise


if __name__ == "__main__":
    sys.exit(main())
