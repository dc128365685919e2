"""
What a run will do and whether it fits, from its configuration alone (no weights, no data): the model config the flags
resolve to, the compute-optimal batch and its learning-rate scale, the device batch the memory estimate fits, the
sharding (--sharding=auto settled by memory), the horizon, and the plan's lines that base_train --dry_run and the
launcher print.

A function that reads many of a run's settings takes its train_config.RunConfig (`run_config`) and returns values,
or a new RunConfig made with dataclasses.replace (none changes the one it is given); one that reads a few takes
those.
"""

import dataclasses
import math
import os

import torch

from nanochat.common import gpu_peak_flops
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.model.supervision import default_head_rows
from nanochat.train import memory
from nanochat.train.flops import estimate_flops, planned_depth, run_flops_per_token
from nanochat.train.probe import build as build_probe

# Model flags that map one-to-one onto GPTConfig fields; None means "not given on the command line".
MODEL_FLAGS = ["n_loops", "T_recursion", "n_sup_train", "n_sup_inference", "activation_fn", "state_update",
               "state_dtype", "sample_n_sup", "detach_between_steps", "backprop_steps",
               "activation_checkpointing",
               "supervision_weight_base", "improvement_reward_scale", "consistency_weight", "halt_head", "n_prelude",
               "n_coda"]
# The compute-optimal batch, as nanochat HEAD derives it: B_REF tokens for the depth-12 reference at its horizon
# D_REF, and B ~ D^BATCH_EXPONENT for other horizons (Power Lines, arXiv 2505.13738), rounded to a power of 2.
B_REF = 2 ** 19
BATCH_EXPONENT = 0.383
REFERENCE_DEPTH = 12
MAX_DEVICE_BATCH = 32  # the largest automatic micro-batch (nanochat's default device batch)
QUIET_ACCUMULATION = 64  # more micro-batches per step than this gets a warning: a small model made to crawl
PLANNER_MFU = 0.40  # model FLOPs utilisation a compiled bf16 run of this size reaches; stated in every plan
# ... in micro-batches of this many tokens (the TRM at depth 12 measured 41.9% at 16 x 2048 on an H100): a plan's
# smaller micro-batches are slowed by memory.micro_batch_efficiency relative to it
PLANNER_MFU_TOKENS = 16 * 2048
# Draws a plan averages for the mean supervision steps when the run's length is not known yet (a --target_flops
# horizon): the curriculum is a fraction of the run, so the mean hardly depends on its length
PLAN_DRAWS = 1000
# Per-GPU collective bandwidths the plan prices communication at (bytes/s): PCIe-class and NVLink-class nodes
LINK_BANDWIDTHS = {"PCIe": 25e9, "NVLink": 300e9}
# auto starts averaging at 300 steps: at CPU scale the average hurt every 128-step run and helped every run of 337 to
# 990 steps (dev/LOG.md, "When the weight average helps").
EMA_AUTO_MIN_STEPS = 300


class PlanError(ValueError):
    """A run that cannot be planned; the message says what to change (parse_args prints it as a usage error)."""


def ema_decay_for(ema_decay, num_iterations):
    """The EMA decay of a run of num_iterations steps: --ema_decay, or for auto an average over about the last tenth of
    a long run."""
    if ema_decay != "auto":
        return ema_decay
    return 1 - 10 / num_iterations if num_iterations >= EMA_AUTO_MIN_STEPS else 0.0


def model_shape(depth, n_embd=None, n_head=None, n_kv_head=None):
    """The GPTConfig shape fields for --depth and the shape flags (None: derived): width 64 per layer, head dim 128."""
    given = lambda value, default: default if value is None else value  # noqa: E731 - 0 is a value, not "unset"
    n_embd = given(n_embd, depth * 64)
    n_head = given(n_head, max(1, n_embd // 128))
    return {"n_layer": depth, "n_embd": n_embd, "n_head": n_head, "n_kv_head": given(n_kv_head, n_head)}


def resolve_model_config(depth, max_seq_len, n_embd=None, n_head=None, n_kv_head=None, preset=None, **model_flags):
    """The effective GPTConfig fields and where each came from: explicit flag > --preset > gpt.py default. The
    arguments are the model flags as parsed (None: not given); model_flags: those of MODEL_FLAGS."""
    unknown = set(model_flags) - set(MODEL_FLAGS)
    if unknown:
        raise TypeError(f"resolve_model_config: not model flags: {sorted(unknown)}")
    defaults = GPTConfig(vocab_size=1)
    values = {**model_shape(depth, n_embd, n_head, n_kv_head), "sequence_len": max_seq_len}
    sources = {"n_layer": "--depth", "sequence_len": "--max_seq_len",
               "n_embd": "--n_embd" if n_embd is not None else "derived from --depth (64 per layer)",
               "n_head": "--n_head" if n_head is not None else "derived (head dim 128)",
               "n_kv_head": "--n_kv_head" if n_kv_head is not None else "= n_head"}
    preset_config = GPTConfig.with_refinement_preset(preset, vocab_size=1) if preset else None
    for name in MODEL_FLAGS:
        if model_flags.get(name) is not None:
            values[name], sources[name] = model_flags[name], "flag"
        elif preset_config and name in ("supervision_weight_base", "improvement_reward_scale"):
            values[name], sources[name] = getattr(preset_config, name), f"preset {preset}"
        else:
            values[name], sources[name] = getattr(defaults, name), "gpt.py default"
    if model_flags.get("n_sup_inference") is None:
        values["n_sup_inference"], sources["n_sup_inference"] = values["n_sup_train"], "= n_sup_train"
    return values, sources


# ---------------------------------------------------------------------------------------------------- the batch
def plan_batch(run_config):
    """run_config with its batch settled: device_batch_size, grad_accum, total_batch_size, lr_scale, the sharding, and
    batch_notes saying why. PlanError when the flags ask for a batch that cannot be.

    Unset, the total batch is compute-optimal for the run's horizon (nanochat HEAD's rule) with learning rates
    scaled by sqrt(batch / B_REF), and the device batch is the largest that the memory estimate fits."""
    world, T = run_config.world_size, run_config.max_seq_len
    accum, total = run_config.gradient_accumulation_steps, run_config.total_batch_size
    memory_at = device_memory(run_config)  # read once: free RAM moves between reads
    run_config = settle_sharding(run_config, memory_at)
    notes, lr_scale = [run_config.sharding_note], 1.0
    if total is None and accum is None:
        total, horizon, reference = optimal_batch(run_config.model_config, run_config.plan_vocab_size,
                                                  run_config.target_flops, run_config.target_param_data_ratio,
                                                  run_config.n_sup_warmup)
        # a whole number of micro-batches (sequences) per process
        micro = (run_config.device_batch_size or 1) * T * world
        total = max(1, round(total / micro)) * micro
        lr_scale = math.sqrt(total / B_REF)
        notes.append(f"total batch {total:,} tokens: compute-optimal for a horizon of {horizon:.3g} tokens "
                     f"({B_REF:,} at the depth-{REFERENCE_DEPTH} horizon {reference:.3g}, x (horizon ratio)^"
                     f"{BATCH_EXPONENT}, a power of 2); learning rates x {lr_scale:.4f} = sqrt(batch / "
                     f"{B_REF:,}). --total_batch_size sets it (and keeps the learning rates)")
    device_batch = run_config.device_batch_size
    if device_batch is None:
        per_rank = total // (T * world) if total is not None and total % (T * world) == 0 else MAX_DEVICE_BATCH
        device_batch, why, run_config = fit_device_batch(run_config, per_rank, memory_at=memory_at,
                                                         allow_checkpointing=may_recompute(run_config))
        if device_batch is None:
            raise PlanError(why)
        notes.append(why)
    tokens_per_micro = device_batch * T * world
    if total is not None:
        given = "--total_batch_size" if run_config.total_batch_size is not None else "the compute-optimal total batch"
        if total < tokens_per_micro or total % tokens_per_micro:
            multiple = max(1, round(total / tokens_per_micro)) * tokens_per_micro
            raise PlanError(f"{given}={total} is not a multiple of processes x device_batch_size x max_seq_len = "
                            f"{world} x {device_batch} x {T} = {tokens_per_micro}; pass "
                            f"--total_batch_size={multiple} (or another multiple of {tokens_per_micro}), or "
                            f"--gradient_accumulation_steps=N for N x {tokens_per_micro} tokens per step")
        if accum is not None and accum != total // tokens_per_micro:
            raise PlanError(f"--total_batch_size={total} implies gradient accumulation {total // tokens_per_micro}, "
                            f"but --gradient_accumulation_steps={accum}; give only one of them")
        accum = total // tokens_per_micro
    total = tokens_per_micro * accum
    if accum > QUIET_ACCUMULATION:
        notes.append(f"WARNING: {accum} micro-batches per optimizer step ({total:,} tokens in "
                     f"micro-batches of {tokens_per_micro:,}): each step will be slow; a smaller --total_batch_size "
                     f"(or --gradient_accumulation_steps) makes more, faster steps")
    head_chunks, head_note = plan_head(run_config, device_batch, memory_at)
    return dataclasses.replace(run_config, device_batch_size=device_batch, grad_accum=accum, total_batch_size=total,
                               lr_scale=lr_scale, head_chunks=head_chunks, batch_notes=(*notes, head_note))


def plan_head(run_config, device_batch, memory_at):
    """(the training head's chunks per micro-batch, why): --head_chunks, or the fewest the memory estimate holds at
    this device batch (memory.head_chunks_that_fit: one compiled region where it can), or None for the default chunk
    (supervision.HEAD_CHUNK_ELEMENTS logits) when no larger one fits."""
    rows = device_batch * run_config.max_seq_len
    if run_config.head_chunks:
        return run_config.head_chunks, (f"training head: {run_config.head_chunks} chunk(s) of "
                                        f"{-(-rows // run_config.head_chunks):,} rows (--head_chunks)")
    config = model_config(run_config, run_config.plan_vocab_size)
    chunks = memory.head_chunks_that_fit(config, device_batch, memory_at[0], run_config.dtype, run_config.world_size,
                                         keeps_ema(run_config.ema_decay, run_config.num_iterations),
                                         run_config.sharding, compiled=run_config.compile)
    if chunks is None:
        return None, (f"training head: chunks of {default_head_rows(config.vocab_size):,} rows (the default: no "
                      f"larger chunk fits the memory; --head_chunks sets it)")
    what = "one chunk" if chunks == 1 else f"{chunks} chunks of {-(-rows // chunks):,} rows"
    return chunks, (f"training head: {what} of the micro-batch's {rows:,} rows, the fewest the memory estimate holds "
                    f"(--head_chunks sets it)")


def settle_sharding(run_config, memory_at):
    """run_config with --sharding=auto settled in `sharding` for memory_at = (bytes per device, where from), and
    sharding_note saying why."""
    sharding, note = sharding_reason(run_config, memory_at)
    return dataclasses.replace(run_config, sharding=sharding, sharding_note=note)


def sharding_reason(run_config, memory_at):
    """(the sharding, why): --sharding as asked, or for auto ddp, unless data parallelism cannot hold one sequence per
    device even with activation checkpointing: then fsdp."""
    if run_config.sharding_requested != "auto":
        return run_config.sharding_requested, f"sharding {run_config.sharding_requested} (--sharding)"
    if run_config.world_size == 1:
        return "ddp", "sharding ddp (auto): one process, nothing to shard"
    memory_bytes, where = memory_at
    usable = memory.usable_bytes(memory_bytes)
    gpt_config = model_config(run_config, run_config.plan_vocab_size).replace(activation_checkpointing=True)
    need = {kind: memory_need(run_config, 1, kind, gpt_config) for kind in ("ddp", "fsdp")}
    sharding = "ddp" if need["ddp"] <= usable else "fsdp"
    return sharding, (f"sharding {sharding} (auto): at 1 sequence with activation checkpointing data parallelism "
                      f"needs ~{need['ddp'] / 1e9:.1f} GB per device, sharded over {run_config.world_size} processes "
                      f"~{need['fsdp'] / 1e9:.1f} GB; {usable / 1e9:.0f} GB usable ({where})"
                      + ("" if sharding == "fsdp" else "; replicated is cheaper in communication (--sharding=fsdp "
                                                       "forces)"))


def optimal_batch(model_config, vocab_size, target_flops, target_param_data_ratio, n_sup_warmup=0.0):
    """(tokens per step, the run's horizon in tokens, the reference horizon): B_REF x (D / D_REF)^BATCH_EXPONENT
    rounded to a power of 2, D from --target_flops (at the mean supervision steps drawn) or the data ratio (as the
    horizon rule, iterations aside). The reference is the run's model (model_config: GPTConfig fields) at depth
    REFERENCE_DEPTH with its shape derived."""
    model = meta_model(GPTConfig(vocab_size=vocab_size, **model_config))
    reference_model = meta_model(GPTConfig(vocab_size=vocab_size,
                                           **{**model_config, **model_shape(REFERENCE_DEPTH)}))
    reference = target_param_data_ratio * reference_model.num_params()
    if target_flops:
        horizon = target_flops / run_flops_per_token(model, n_sup_warmup, PLAN_DRAWS)
    else:
        horizon = target_param_data_ratio * model.num_params()
    return 2 ** round(math.log2(B_REF * (horizon / reference) ** BATCH_EXPONENT)), horizon, reference


def may_recompute(run_config):
    """Whether the plan may turn activation checkpointing on: on GPUs (the time model is theirs), unless
    --activation_checkpointing was given."""
    return run_config.device_type == "cuda" and run_config.config_sources.get("activation_checkpointing") != "flag"


def fit_device_batch(run_config, sequences_per_rank, max_batch=MAX_DEVICE_BATCH, allow_checkpointing=False,
                     memory_at=None):
    """(the device batch up to max_batch that divides sequences_per_rank, fits the device's memory and trains
    fastest by the planned time (memory.choose_micro_batch), why, run_config); (None, what to do, run_config) when
    not even one sequence fits. Activation checkpointing, when allowed and faster than more accumulation, is turned
    on in the returned run_config's model_config. The launcher fits its table's batch with this function too.
    memory_at: (bytes per device, where the number comes from), default device_memory(run_config); run_config's
    sharding must be settled for it (settle_sharding)."""
    memory_bytes, where = memory_at or device_memory(run_config)
    config = model_config(run_config, run_config.plan_vocab_size)
    choice = memory.choose_micro_batch(config, sequences_per_rank, min(max_batch, sequences_per_rank), memory_bytes,
                                       run_config.dtype, run_config.world_size,
                                       allow_checkpointing=allow_checkpointing,
                                       ema=keeps_ema(run_config.ema_decay, run_config.num_iterations),
                                       sharding=run_config.sharding)
    if choice is None:
        return None, (f"not even one sequence of {run_config.max_seq_len} tokens fits in {memory_bytes / 1e9:.0f} GB "
                      f"per device ({where}; estimate): turn on --activation_checkpointing, or lower --max_seq_len or "
                      f"--depth"), run_config
    batch, checkpointing = choice.chosen.batch, choice.chosen.checkpointing
    if checkpointing and not config.activation_checkpointing:
        run_config = dataclasses.replace(
            run_config, model_config={**run_config.model_config, "activation_checkpointing": True},
            config_sources={**run_config.config_sources,
                            "activation_checkpointing": "turned on: faster than more accumulation (the plan)"})
    need = memory_need(run_config, batch)
    return batch, (f"device batch {batch}{' with activation checkpointing' if checkpointing else ''}: the largest "
                   f"of at most {max_batch} that divides the {sequences_per_rank} sequences per process and fits "
                   f"~{need / 1e9:.1f} GB in {memory.usable_bytes(memory_bytes) / 1e9:.0f} GB usable of "
                   f"{memory_bytes / 1e9:.0f} GB ({where})" + recompute_or_accumulate(choice, config)), run_config


def describe_micro_batch(m, config):
    tokens = m.batch * config.sequence_len
    what = (f"activation checkpointing at batch {m.batch} (+{memory.recompute_share(config):.0%} FLOPs recomputed, "
            if m.checkpointing else f"batch {m.batch} with more accumulation (")
    return (f"{what}{tokens:,}-token micro-batches at {memory.micro_batch_efficiency(tokens):.0%} of a large one's "
            f"rate): {m.time:.2f}x")


def recompute_or_accumulate(choice, config):
    """The plan's words on the choice between more accumulation and recomputation, when both were weighed: each one's
    planned time, relative to the same FLOPs in large micro-batches without recomputation."""
    if choice.other is None:
        return ""
    chosen = describe_micro_batch(choice.chosen, config)
    return (f"; {'recompute' if choice.chosen.checkpointing else 'accumulate'}: {chosen}, against "
            f"{describe_micro_batch(choice.other, config)} the time of the same FLOPs in large micro-batches "
            f"(memory.MICRO_BATCH_OVERHEAD_TOKENS)")


def step_seconds(run_config, model, peak, iterations):
    """Planned seconds of one optimizer step: the run's mean training FLOPs (the supervision steps drawn, on average,
    flops.run_flops_per_token), plus what activation checkpointing recomputes, at PLANNER_MFU of the world's peak,
    slowed (or sped) by the micro-batch's efficiency relative to PLANNER_MFU_TOKENS' (memory.micro_batch_efficiency)."""
    config = model.config
    flops = run_flops_per_token(model, run_config.n_sup_warmup, iterations) * run_config.total_batch_size
    if config.activation_checkpointing:
        flops *= 1 + memory.recompute_share(config)
    return flops / (run_config.world_size * peak * PLANNER_MFU) * micro_batch_slowdown(run_config)


def micro_batch_slowdown(run_config):
    """How much slower than at PLANNER_MFU_TOKENS a GPU runs the plan's micro-batch (memory.micro_batch_efficiency,
    a GPU's: 1 elsewhere)."""
    if run_config.device_type != "cuda":
        return 1.0
    tokens = run_config.device_batch_size * run_config.max_seq_len
    return memory.micro_batch_efficiency(PLANNER_MFU_TOKENS) / memory.micro_batch_efficiency(tokens)


def memory_need(run_config, batch, sharding=None, config=None):
    """Bytes per device that memory.estimate_memory gives the run at device batch `batch` (sharding: default the
    run's; config: a GPTConfig, default the run's model)."""
    return memory.estimate_memory(config or model_config(run_config, run_config.plan_vocab_size), batch,
                                  run_config.dtype, run_config.world_size,
                                  keeps_ema(run_config.ema_decay, run_config.num_iterations),
                                  sharding or run_config.sharding, run_config.head_chunks,
                                  run_config.compile)["total"]


def device_memory(run_config):
    """(bytes per device, where the number comes from): --device_memory_gb, the GPU's, or free RAM per process."""
    if run_config.device_memory_gb:
        return int(run_config.device_memory_gb * 1e9), "--device_memory_gb"
    if run_config.device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    return free_ram_per_process(run_config.world_size)


def free_ram_per_process(processes):
    """(bytes, where from): the machine's free RAM shared by the processes, the memory of a CPU run. Free counts the
    page cache the kernel gives back on demand (MemAvailable): MemFree alone shrinks to a few GB once files were read,
    and a machine with 19 GB to give refused a depth-2 run as if it had 2."""
    available = host_ram_available() or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
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


def host_ram_problem(config):
    """A line saying why this node's RAM cannot hold the weight each FSDP rank on it draws whole to initialise the
    shards of a model of GPTConfig `config`, or None."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's processes on this node
    need = memory.sharded_build_host_bytes(config, processes)
    have = host_ram_available()
    if have is None or need <= have:
        return None
    return (f"--sharding=fsdp: each of the {processes} processes on this node draws the model's largest float32 weight "
            f"whole in host RAM to initialise its shards, ~{need / 1e9:.1f} GB in all, but {have / 1e9:.1f} GB is "
            f"available; run fewer processes per node, or on a node with more RAM")


def keeps_ema(ema_decay, num_iterations):
    """Whether a run keeps an EMA copy of the weights (--ema_decay; auto depends on --num_iterations)."""
    if num_iterations is None:  # the length comes from --target_flops or a data ratio: count the copy unless off
        return ema_decay != 0
    return ema_decay_for(ema_decay, num_iterations) > 0


def plan_lines(run_config):
    """What a run will do and cost, from its flags alone: base_train --dry_run prints these and exits."""
    config = model_config(run_config, run_config.plan_vocab_size)
    model = meta_model(config)
    iterations, source = num_iterations_for(run_config, model)
    memory_bytes, where = device_memory(run_config)
    need = memory_need(run_config, run_config.device_batch_size, config=config)
    depth = planned_depth(config, run_config.n_sup_warmup, iterations)
    flops_per_token = estimate_flops(model, n_sup=depth)
    flops_per_step = flops_per_token * run_config.total_batch_size
    lines = [f"processes    {run_config.world_size} x {run_config.device_type}, {run_config.dtype}, compile "
             f"{run_config.compile}" + (f" (scope {run_config.compile_scope})" if run_config.compile else ""),
             f"model        depth {config.n_layer}, width {config.n_embd}, n_loops {config.n_loops}, "
             f"{config.n_sup_train} supervision steps, vocab {config.vocab_size:,}: {model.num_params():,} parameters",
             f"batch        {run_config.world_size} x {run_config.device_batch_size} sequences x "
             f"{run_config.max_seq_len} tokens x {run_config.grad_accum} accumulation = "
             f"{run_config.total_batch_size:,} tokens per step",
             *[f"             {note}" for note in run_config.batch_notes],
             f"memory       ~{need / 1e9:.1f} GB per device (nanochat/train/memory.py) of "
             f"{memory.usable_bytes(memory_bytes) / 1e9:.0f} GB usable ({memory_bytes / 1e9:.0f} GB, {where})"
             + ("" if need <= memory.usable_bytes(memory_bytes) else "  -> predicted OUT OF MEMORY"),
             f"compute      {flops_per_token:.3e} FLOPs per token{drawn_note(config, depth)} x "
             f"{run_config.total_batch_size:,} tokens = {flops_per_step:.3e} FLOPs per step; {iterations} steps "
             f"({source})",
             evaluation_line(run_config, model, iterations, flops_per_step),
             *probe_lines(run_config, model, iterations)]
    peak = peak_flops(run_config.peak_tflops, run_config.device_type)
    if peak:
        seconds = step_seconds(run_config, model, peak, iterations)
        cost = (f", ${seconds * iterations / 3600 * run_config.gpu_hourly_price * run_config.world_size:,.2f} at "
                f"${run_config.gpu_hourly_price}/GPU-hour" if run_config.gpu_hourly_price else "")
        lines.append(f"time         {peak / 1e12:,.0f} TFLOP/s per device at {PLANNER_MFU:.0%} MFU"
                     f"{time_note(run_config, config)}: {seconds:.2f} s per step, {seconds * iterations / 3600:.2f} h "
                     f"for {iterations} steps{cost}")
        lines += budget_lines(run_config.max_hours, run_config.total_batch_size, seconds, iterations)
    else:
        lines.append("time         unknown: no GPU in the peak-FLOPs table here; --peak_tflops gives one")
    return lines + sharding_lines(run_config, config, memory_bytes)


def drawn_note(config, depth):
    """What the plan's FLOPs count when a run draws its supervision steps: their mean, against n_sup_train."""
    if depth == config.n_sup_train:
        return ""
    return (f" (the mean {depth:.2f} supervision steps drawn, of {config.n_sup_train} nominal: --sample_n_sup, "
            f"--n_sup_warmup)")


def time_note(run_config, config):
    """What the plan's time adds to the FLOPs at PLANNER_MFU: recomputation, a micro-batch's efficiency."""
    notes = [f"+{memory.recompute_share(config):.0%} FLOPs recomputed (activation checkpointing)"] \
        if config.activation_checkpointing else []
    slowdown = micro_batch_slowdown(run_config)
    if abs(slowdown - 1) >= 0.005:
        notes.append(f"{slowdown:.2f}x the time for micro-batches of "
                     f"{run_config.device_batch_size * run_config.max_seq_len:,} tokens against {PLANNER_MFU_TOKENS:,}")
    return f" ({'; '.join(notes)})" if notes else ""


def evaluations(eval_every, iterations):
    """How many validation evals a run does: at step 0, every --eval_every steps, and at the end."""
    if not eval_every:
        return 1
    return iterations // eval_every + 1 + (iterations % eval_every != 0)


def evaluation_line(run_config, model, iterations, flops_per_step):
    """The validation evals' share of the run's compute (forward only, every supervision step, compiled)."""
    n = evaluations(run_config.eval_every, iterations)
    flops = n * run_config.eval_tokens * estimate_flops(model, backward=False)
    share = flops / (flops + iterations * flops_per_step)
    return (f"evaluation   {n} evals x {run_config.eval_tokens:,} tokens x {estimate_flops(model, backward=False):.3e} "
            f"FLOPs = {flops:.3e} FLOPs: {share:.1%} of the run's compute")


def probe_lines(run_config, model, iterations):
    """What --probe costs: its share of the training tokens (text the run does not see) and its evaluations."""
    if run_config.probe == "none":
        return []
    probe = build_probe(run_config.probe, run_config.probe_share, run_config.seed, run_config.probe_docs)
    doc_chars = len(probe.eval_documents()[0])  # about one token a character: answers are, the rest merges less
    eval_flops = (evaluations(run_config.eval_every, iterations) * run_config.probe_docs * doc_chars
                  * estimate_flops(model, backward=False))
    train_flops = iterations * run_config.total_batch_size * run_flops_per_token(model, run_config.n_sup_warmup,
                                                                                  iterations)
    rows = min(1.0, run_config.probe_share * (run_config.max_seq_len + 1) / (doc_chars + 1))
    return [f"probe        {run_config.probe}: {run_config.probe_share:.0%} of the training tokens are hops documents, "
            f"one at the start of {rows:.0%} of the rows (that much less text), and {run_config.probe_docs} documents "
            "at each eval: "
            f"{eval_flops / train_flops:.2%} more compute"]


def peak_flops(peak_tflops, device_type, device=0):
    """The device's dense bf16 peak FLOP/s, for MFU and the plan's time: --peak_tflops, else the GPU's entry in the
    peak-FLOPs table (nanochat/common.py), else None (no MFU shown)."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device_type == "cuda" and torch.cuda.is_available():
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return None


def sharding_lines(run_config, config, memory_bytes):
    """The sharding chosen, why, what each choice needs per device and sends per step (the plan's 'sharding')."""
    if run_config.world_size == 1:
        return [f"sharding     {run_config.sharding}: one process, no collectives"]
    lines = [f"sharding     {run_config.sharding_note.removeprefix('sharding ')}"]
    for kind in ("ddp", "fsdp"):
        need = memory_need(run_config, run_config.device_batch_size, kind, config)
        sent, gathers = memory.collective_bytes(config, kind, run_config.world_size, run_config.grad_accum,
                                                run_config.dtype)
        at = ", ".join(f"{sent / bandwidth:.2f} s at {bandwidth / 1e9:.0f} GB/s ({link})"
                       for link, bandwidth in LINK_BANDWIDTHS.items())
        what = (f"{sum(gathers.values())} parameter all-gathers per micro-step, x {run_config.grad_accum} micro-steps"
                if gathers else "one gradient reduce-scatter and one weight all-gather per step")
        host = (f"; needs ~{memory.sharded_build_host_bytes(config, 1) / 1e9:.1f} GB host RAM per process at start "
                f"(its largest float32 weight, drawn whole to initialise the shards)" if kind == "fsdp" else "")
        lines.append(f"  {kind}{' (chosen)' if kind == run_config.sharding else ''}: ~{need / 1e9:.1f} GB per device"
                     f"{'' if need <= memory.usable_bytes(memory_bytes) else ' (does NOT fit)'}; sends "
                     f"~{sent / 1e9:.1f} GB per device per step ({what}): {at} if not overlapped with compute{host}")
    return lines


def budget_lines(max_hours, tokens_per_step, seconds_per_step, iterations):
    """What --max_hours buys at the planned step time: steps and tokens (the run stops there, saved)."""
    if not max_hours:
        return []
    steps = int(max_hours * 3600 / seconds_per_step)
    return [f"budget       --max_hours={max_hours:g}: ~{min(steps, iterations):,} of {iterations:,} steps, "
            f"~{min(steps, iterations) * tokens_per_step:,} tokens at {PLANNER_MFU:.0%} MFU"]


def num_iterations_for(run_config, model):
    """(optimizer steps, where the number comes from): --num_iterations, or --target_flops over the training FLOPs of
    a step (at the mean supervision steps the run draws: that mean depends on the run's length through the
    curriculum, so the two are settled together), or the data ratio's tokens over the batch."""
    if run_config.num_iterations:
        return run_config.num_iterations, "--num_iterations"
    if run_config.target_flops:
        steps = lambda n: max(1, round(run_config.target_flops / (run_config.total_batch_size  # noqa: E731
                                                                  * run_flops_per_token(model,
                                                                                        run_config.n_sup_warmup, n))))
        iterations = steps(PLAN_DRAWS)
        for _ in range(5):  # a fixed point; the mean depth barely moves with the length, so it settles at once
            settled = steps(iterations)
            if settled == iterations:
                break
            iterations = settled
        return iterations, f"--target_flops={run_config.target_flops:g}"
    tokens = run_config.target_param_data_ratio * model.num_params()
    return (max(1, round(tokens / run_config.total_batch_size)),
            f"--target_param_data_ratio={run_config.target_param_data_ratio:g}")


def model_config(run_config, vocab_size):
    """The GPTConfig a run (a RunConfig) trains."""
    return GPTConfig(vocab_size=vocab_size, **run_config.model_config)


def meta_model(config):
    """The model without memory or init (meta device): enough for parameter and FLOP counts."""
    with torch.device("meta"):
        return GPT(config)
