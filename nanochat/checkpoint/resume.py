"""Starting or continuing a run on a tag: a fresh run never mixes with another run's checkpoints; a resumed one checks,
before anything is written, that the checkpoint fits this run (model config, batch geometry, sharding, tokenizer, data
and its positions), agrees with every rank on the checkpoint to load (ResumePoint), and puts it into the process."""

import os
import time
from typing import NamedTuple

from nanochat.checkpoint.backup import Backup
from nanochat.checkpoint.manager import (
    SHARD_INDEX,
    TRAIN_WEIGHTS,
    CheckpointError,
    list_steps,
    load_model_weights,
    load_rank_state,
    model_dir,
    read_meta,
    resolve_step,
    step_dir,
)
from nanochat.checkpoint.safe_load import NO_CHECKPOINT_DOES, load_shards, shard_reader, unreadable
from nanochat.collectives import RankFailure, raise_if_any_rank_failed, run_on_rank0
from nanochat.common import get_dist_info, print0, set_rng_state
from nanochat.data.dataloader import training_loaders
from nanochat.data.dataset import DatasetError
from nanochat.model.gpt import GPTConfig
from nanochat.train.lifecycle import RUN_LOCK
from nanochat.train.optim import lr_multiplier


# ---------------------------------------------------------------------------------------------------- a new run
def previous_run(model_tag):
    """What a previous run left in the tag's directory, in words, or None when there is nothing."""
    directory = model_dir(model_tag)
    entries = sorted(set(os.listdir(directory)) - {RUN_LOCK}) if os.path.isdir(directory) else []
    if not entries:
        return None
    steps = list_steps(model_tag)
    if steps:
        return f"checkpoints at steps {', '.join(map(str, steps))}"
    return f"{', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''} but no checkpoint"


def check_fresh_start(model_tag, overwrite, backup_url=None):
    """A fresh run must not mix with another run in one directory. Raises CheckpointError saying what to do, or
    (with overwrite) returns what will be moved aside."""
    found = previous_run(model_tag)
    if backup_url and Backup.location(backup_url, model_tag).steps():
        raise CheckpointError(f"the backup {backup_url} already holds checkpoints of {model_tag!r}: continue that run "
                              f"with --resume, or start this one under a new --model_tag")
    if found is None:
        return None
    if not overwrite:
        raise CheckpointError(f"model tag {model_tag!r} already holds a run in {model_dir(model_tag)} ({found}): add "
                              f"--resume to continue it, choose a new --model_tag, or pass --overwrite to start over "
                              f"(the old run is moved to {model_tag}.replaced-<date>/, nothing is deleted)")
    return found


def move_aside(model_tag):
    """Rename the tag's directory to <tag>.replaced-<date>; returns the new path. Nothing is deleted."""
    aside = f"{model_dir(model_tag)}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(model_dir(model_tag), aside)
    return aside


def resumable_meta(model_tag, step=None):
    """The meta.json that --resume (step None: the latest) or --resume_from_step would continue, or None when there is
    none or it is unreadable (the resume itself then says why): what train.config keeps of the run's recipe."""
    steps = list_steps(model_tag)
    if not steps:
        return None
    try:
        return read_meta(model_tag, steps[-1] if step is None else step)
    except CheckpointError:
        return None


# ---------------------------------------------------------------------------------------------------- resume checks
# Fields that may differ between a checkpoint and the run resuming it: they change no weight and no training math.
RESUMABLE_CONFIG_CHANGES = {"n_sup_inference", "activation_checkpointing"}


def config_differences(saved, current):
    """Names and values of model-config fields that differ in a way that makes resuming wrong."""
    return [f"{k}: checkpoint {saved.get(k)!r} vs this run {current.get(k)!r}"
            for k in sorted(set(saved) | set(current))
            if k not in RESUMABLE_CONFIG_CHANGES and saved.get(k) != current.get(k)]


def checkpoint_sharding(meta):
    """'fsdp' for a sharded checkpoint, 'ddp' for one with replicated weights (and for those that predate the flag)."""
    return meta.get("train_config", {}).get("sharding", "ddp")


def data_order(geometry):
    """What fixes the data of every step: the number of data ranks (processes x accumulation) and their shapes."""
    return {"data ranks (processes x accumulation)": geometry.get("world_size", 0) * geometry.get("grad_accum", 0),
            "device_batch_size": geometry.get("device_batch_size"), "max_seq_len": geometry.get("max_seq_len")}


def resume_differences(meta, model_config, batch_geometry, sharding="ddp"):
    """Why a run with this model config, batch geometry and sharding cannot continue the checkpoint `meta` ([] when
    it can). A sharded checkpoint resumes on any process count with the same data ranks; a DDP one on its own."""
    saved = meta.get("batch_geometry", {})
    saved_config = GPTConfig.from_dict(meta["model_config"]).to_dict()  # fields it predates: their old behaviour
    if checkpoint_sharding(meta) != sharding:
        return [f"sharding: checkpoint {checkpoint_sharding(meta)!r} vs this run {sharding!r} (pass "
                f"--sharding={checkpoint_sharding(meta)})"]
    if sharding == "fsdp":
        saved, batch_geometry = data_order(saved), data_order(batch_geometry)
    return config_differences(saved_config, model_config) + [
        f"{k}: checkpoint {saved.get(k)!r} vs this run {v!r}" for k, v in batch_geometry.items() if saved.get(k) != v]


def shards(n):
    return f"{n} shard" if n == 1 else f"{n} shards"


def check_data(meta, corpus, allow_change, what):
    """Refuse to continue a checkpoint on other data than it was trained on (a shard replaced, added or removed,
    another NANOCHAT_DATA_DIR); corpus: dataset.corpus_identity(). allow_change warns instead."""
    saved = meta.get("data")
    if saved is None:
        print0(f"note: {what} records no data fingerprint (it predates them), so nothing checks that {corpus['dir']} "
               f"holds the data it was trained on")
        return
    if saved["fingerprint"] == corpus["fingerprint"]:
        return
    change = (f"{what} was trained on data {saved['fingerprint']} ({shards(saved['shards'])} in {saved['dir']}), "
              f"but this run's data is {corpus['fingerprint']} ({shards(corpus['shards'])} in {corpus['dir']})")
    if not allow_change:
        raise CheckpointError(f"{change}: a shard was replaced, added or removed, or NANOCHAT_DATA_DIR points "
                              f"elsewhere; restore the data it was trained on, or pass --allow_data_change to go on "
                              f"with this data")
    print0(f"WARNING: --allow_data_change: {change}; going on with this data")


def check_data_positions(point, run_config, rank, tokenizer, loaders=training_loaders):
    """Refuse, on every rank, a checkpoint whose data positions the current shards do not hold: one line before
    anything is written, rather than the loader's traceback after 'resumed'. Opens this process's train loaders
    at their saved positions, as base_train does, so the loader's own rule decides. run_config: the run's RunConfig;
    loaders: how the run opens them (chat_sft's conversations have loaders of their own)."""
    error = None
    try:
        loaders(run_config, tokenizer, rank, point.rank_state["loaders"])
    except ValueError as e:
        error = CheckpointError(f"the data position saved in step {point.step} is not in the current data ({e}); "
                                f"restore the data it was trained on, or start a new --model_tag")
    except DatasetError as e:  # every rank must learn of it
        error = e
    raise_if_any_rank_failed(error, "checking the data positions")


def report_schedule_change(point, schedule, horizon_source):
    """Say, in one line, how this run's learning-rate schedule differs from the checkpoint's (nothing when it does
    not): resuming with a longer horizon is how a run is extended, but it moves the warmdown and so the lr.
    schedule: (num_iterations, warmup_steps, warmdown_ratio, final_lr_frac), optim.lr_multiplier's arguments."""
    config = point.meta.get("train_config", {})
    saved = (point.meta.get("num_iterations"), point.meta.get("warmup_steps"), config.get("warmdown_ratio"),
             config.get("final_lr_frac"))
    names = ("horizon {} -> {} steps ({})", "warmup {} -> {} steps", "warmdown ratio {} -> {}",
             "final lr fraction {} -> {}")
    changes = [name.format(old, new, horizon_source) for name, old, new in zip(names, saved, schedule)
               if old is not None and old != new]  # None: a checkpoint that predates the record
    if not changes:
        return
    new_lrm = lr_multiplier(point.step, *schedule)
    old_lrm = f"{lr_multiplier(point.step, *saved):.2f}" if None not in saved else "unrecorded"
    keep = f" (--num_iterations={saved[0]} keeps the checkpoint's horizon)" if saved[0] != schedule[0] else ""
    print0(f"resuming with another learning-rate schedule: {', '.join(changes)}; the lr multiplier of step "
           f"{point.step + 1}: {old_lrm} -> {new_lrm:.2f}{keep}")


# ---------------------------------------------------------------------------------------------------- the resume point
class ResumePoint(NamedTuple):
    """What a run resumes from: the checkpoint's step and meta.json, its published weights, this rank's state
    (optimizers, RNG, loaders) and, with a weight average, the raw weights training goes on from (else None). A
    sharded checkpoint's weights and optimizer state stay on disk (weights None, rank_state["shards"] their
    directory) until restore() reads this rank's shards."""
    step: int
    meta: dict
    weights: dict
    rank_state: dict
    train_weights: dict | None


def process_count_problem(model_tag, step, meta, world_size):
    """Why a run of world_size processes cannot continue this checkpoint (None when it can): each process saved its
    own share of the optimizer state (ZeRO-1) and its own data positions, so only the saving process count fits."""
    geometry = meta.get("batch_geometry", {})
    saved = geometry.get("world_size")
    if saved in (None, world_size):  # None: it predates the record, and resume_differences names what differs
        return None
    launch = "python -m scripts.base_train" if saved == 1 else \
        f"torchrun --nproc_per_node={saved} -m scripts.base_train --"
    return (f"checkpoint step {step} of {model_tag!r} was written by {processes(saved)} and this run has "
            f"{world_size}; each process saved its own optimizer shard and data position, so resume it on {saved}: "
            f"{launch} <the same flags> --resume (--device_batch_size={geometry.get('device_batch_size')} "
            f"--gradient_accumulation_steps={geometry.get('grad_accum')}, as saved), or train on {world_size} under "
            f"a new --model_tag")


def processes(n):
    return f"{n} process" if n == 1 else f"{n} processes"


def _agreed(work, what):
    """work()'s result on every rank, or RankFailure on every rank when it raised CheckpointError on any."""
    error, result = None, None
    try:
        result = work()
    except CheckpointError as e:
        error = e
    raise_if_any_rank_failed(error, what)
    return result


def load_resume_point(model_tag, which, rank, backup_url=None, world_size=None, data_ranks=None):
    """The ResumePoint to resume from, agreed by every rank of world_size (default: this process group's); data_ranks:
    this rank's (dataloader.data_ranks), whose loader positions a sharded checkpoint gives from any saving process.

    which: 'latest' or a step. An empty local directory is first filled from the backup. With 'latest', a checkpoint
    that fails to load on any rank is skipped, with the reason, for the next newest; one holding an object no checkpoint
    holds (an altered file) is refused. A checkpoint written by another process count is refused (CheckpointError),
    never skipped: it is intact, only this launch does not fit it; a sharded one is not (resume_differences checks its
    data ranks)."""
    world_size = world_size or get_dist_info()[3]
    if backup_url and not list_steps(model_tag):  # rank 0 downloads; the others wait without nearing the timeout
        error = run_on_rank0(lambda: Backup.location(backup_url, model_tag).restore(which), rank)
        raise_if_any_rank_failed(error, f"restoring {model_tag} from the backup {backup_url}")
    newest = resolve_step(model_tag, which)
    candidates = [s for s in reversed(list_steps(model_tag)) if s <= newest] if which in (None, "latest") else [newest]
    for step in candidates:
        what = f"loading checkpoint step {step}"
        try:
            meta = _agreed(lambda: read_meta(model_tag, step), what)
            if "halt_train" in meta:  # its rank file holds the head's optimizer only, and no data positions
                source = meta["halt_train"]["from"]
                raise CheckpointError(f"{model_tag!r} was written by scripts.halt_train (a halting head added to "
                                      f"{source!r}), not by a training run: resume {source!r} instead, or use "
                                      f"{model_tag!r} for evaluation, sampling, serving and export")
            if checkpoint_sharding(meta) == "fsdp":
                return _agreed(lambda: ResumePoint(step, meta, None, sharded_rank_state(model_tag, step, meta, rank,
                                                                                        data_ranks), None), what)
            problem = process_count_problem(model_tag, step, meta, world_size)
            if problem:  # before any rank file is opened: a missing rank_R.pt here means no fault
                raise CheckpointError(problem)
            return _agreed(lambda: ResumePoint(step, meta, load_model_weights(model_tag, step, "cpu"),
                                               load_rank_state(model_tag, step, rank),
                                               load_model_weights(model_tag, step, "cpu", TRAIN_WEIGHTS)), what)
        except RankFailure as failure:
            if NO_CHECKPOINT_DOES in str(failure):  # an altered file is not damage: going on would hide it
                raise CheckpointError(str(failure)) from failure
            print0(f"WARNING: skipping checkpoint step {step} of {model_tag}: {failure}")
    raise CheckpointError(f"no loadable checkpoint of {model_tag!r} (tried steps {candidates}, see the warnings "
                          f"above); start a new run with another --model_tag, or --overwrite")


def sharded_rank_state(model_tag, step, meta, rank, data_ranks):
    """A sharded checkpoint's state for this rank: RNG states (its own, or rank 0's when it saved with fewer
    processes) and the loader positions of its data ranks, whichever process saved them (None for a data rank the
    checkpoint does not have: resume_differences refuses that geometry). Reads the shards' index, so a damaged one
    is found here."""
    directory = step_dir(model_tag, step)
    try:
        shard_reader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - a missing or truncated index raises whatever its reader raises
        raise CheckpointError(unreadable(os.path.join(directory, SHARD_INDEX), e)) from e
    geometry = meta["batch_geometry"]
    saved = [load_rank_state(model_tag, step, r) for r in range(geometry["world_size"])]
    by_data_rank = {r * geometry["grad_accum"] + j: position
                    for r, state in enumerate(saved) for j, position in enumerate(state["loaders"])}
    return {"rng": saved[rank if rank < len(saved) else 0]["rng"],
            "loaders": [by_data_rank.get(d) for d in data_ranks], "shards": directory}


def restore_shards(directory, model, optimizers, ema):
    """Load this rank's shards of a sharded checkpoint (any process count saved it) into a sharded model, its
    optimizers and EMA; a shard that fails to load (on any rank: DCP agrees) is a CheckpointError on every rank."""
    from nanochat.train import (
        sharding,  # lazy: it loads FSDP (~1.5 s), which halt_train (a fresh-start check) need not pay
    )
    index = shard_reader(directory).read_metadata().state_dict_metadata
    trained = "train_model" if any(key.startswith("train_model.") for key in index) else "model"
    state = {trained: model.state_dict(), "optim": sharding.optimizer_state(model, optimizers)}
    try:
        load_shards(state, directory)  # DTensors in place, plain values (AdamW's step) replaced
        if ema is not None:
            load_shards({"model": ema.module.state_dict()}, directory)
    except Exception as e:  # noqa: BLE001 - a damaged shard raises whatever its reader raises
        raise CheckpointError(unreadable(f"the shards in {directory}", e)) from e
    sharding.load_optimizer_state(model, optimizers, state["optim"])


def restore(point, model, optimizers, ema=None):
    """Put a resume point's weights, optimizer states and RNG states into this process; returns its loader states.
    ema: a weight_average.WeightAverage of model, continued from the published weights."""
    state = point.rank_state
    if "shards" in state:
        restore_shards(state["shards"], model, optimizers, ema)
        if ema is not None:
            ema.started = True
        set_rng_state(state["rng"])
        return state["loaders"]
    model.load_state_dict(point.train_weights if point.train_weights is not None else point.weights)
    if ema is not None:
        ema.module.load_state_dict(point.weights)
        ema.started = True  # an average already started: the next update blends, not copies
    for opt, opt_state in zip(optimizers, state["optimizers"]):
        opt.load_state_dict(opt_state)
    set_rng_state(state["rng"])
    return state["loaders"]
