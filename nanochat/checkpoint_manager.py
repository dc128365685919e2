"""
Checkpoints under $NANOCHAT_BASE_DIR/base_checkpoints/<model_tag>/step_NNNNNN/:
    model.safetensors   model weights (rank 0); checkpoints from before safetensors hold model.pt, still loaded
    rank_R.pt           rank R's optimizer state, dataloader position and RNG states: tensors and plain data only
    .metadata, __R_0.distcp   instead, under --sharding=fsdp: weights and optimizer state as every rank's shards
                        (torch.distributed.checkpoint), readable by any number of processes, or one without a group
    meta.json           step, effective model config, user flags, tokenizer fingerprint, val bpb per step, time, cost

A checkpoint is written into step_NNNNNN.tmp/ and the directory is renamed into place only when every file is
complete and fsynced, so a process killed mid-save leaves the previous checkpoint intact and loadable. Every rank
takes part in a save and a failure on any rank (a full disk) is agreed by all: the partial .tmp is removed and every
rank raises CheckpointError. A .tmp left by a kill is removed by the next run of the tag.

The policy: a fresh run never writes into a tag that holds another run (--resume continues it, --overwrite moves it
aside); --resume skips a corrupt newest checkpoint for the newest loadable one and says why; retention keeps the
newest K and the best; a backup URL (any fsspec filesystem) gets a copy of each checkpoint from a background thread.

No file of a checkpoint can run code when read, so a checkpoint from a backup or another machine is only data: weights
are safetensors, rank files load with torch.load(weights_only=True), and a sharded checkpoint is read through
shard_reader and shard_planner. A file holding anything else is refused in one line naming what it holds.
"""

import argparse
import errno
import functools
import glob
import json
import io
import os
import pickle
import posixpath
import random
import shutil
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np
import torch

from nanochat.common import (RankFailure, describe_error, fsync_dir, get_base_dir, get_dist_info, print0,
                             raise_if_any_rank_failed, run_on_rank0)
from nanochat.gpt import GPT, GPTConfig
from nanochat.lifecycle import RUN_LOCK

WEIGHTS, LEGACY_WEIGHTS = "model.safetensors", "model.pt"
SHARD_INDEX = ".metadata"  # a sharded checkpoint's index (torch.distributed.checkpoint); its shards: __R_0.distcp
TRAIN_WEIGHTS = "train_weights.safetensors"  # with --ema_decay: model.safetensors holds the EMA, this what trains on
# Fields that may differ between a checkpoint and the run resuming it: they change no weight and no training math.
RESUMABLE_CONFIG_CHANGES = {"n_sup_inference", "activation_checkpointing"}
BACKUP_EXIT_WAIT_S = 600  # how long a finished run waits for an upload still in flight


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message names the file and what to do."""


def checkpoints_root():
    return os.path.join(get_base_dir(), "base_checkpoints")


def model_dir(model_tag):
    return os.path.join(checkpoints_root(), model_tag)


def step_dir(model_tag, step):
    return os.path.join(model_dir(model_tag), f"step_{step:06d}")


def list_steps(model_tag):
    """Steps with a complete checkpoint (a final-named directory holding meta.json), ascending."""
    steps = []
    for path in glob.glob(os.path.join(model_dir(model_tag), "step_*")):
        name = os.path.basename(path)
        if name[5:].isdigit() and os.path.exists(os.path.join(path, "meta.json")):
            steps.append(int(name[5:]))
    return sorted(steps)


def read_meta(model_tag, step):
    path = os.path.join(step_dir(model_tag, step), "meta.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({describe_error(e)})") from e


def final_val_bpb(meta):
    bpb = meta.get("val_bpb")
    return bpb[-1] if bpb else None


def best_of(bpb_by_step):
    """The step whose final-step validation bpb is lowest, or None when none has one."""
    scored = [(bpb, step) for step, bpb in bpb_by_step.items() if bpb is not None]
    return min(scored)[1] if scored else None


def readable_bpb(model_tag):
    """{step: final-step val bpb or None} over the checkpoints whose meta.json reads (a corrupt one is never best)."""
    bpb = {}
    for step in list_steps(model_tag):
        try:
            bpb[step] = final_val_bpb(read_meta(model_tag, step))
        except CheckpointError:
            pass
    return bpb


def best_step(model_tag):
    """The step whose final-step validation bpb is lowest (the best checkpoint is often not the last)."""
    return best_of(readable_bpb(model_tag))


def steps_to_prune(bpb_by_step, keep_last):
    """Retention: every step but the newest keep_last and the best by final-step validation bpb (0 keeps all)."""
    if keep_last <= 0:
        return []
    steps = sorted(bpb_by_step)
    keep = set(steps[-keep_last:]) | {best_of(bpb_by_step)}
    return [s for s in steps if s not in keep]


def step_arg(value):
    """argparse type of --step: 'latest', 'best' or a step number (resolve_step finds it)."""
    if value in ("latest", "best") or value.isdigit():
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: use 'latest', 'best' or a step number")


def resolve_step(model_tag, which):
    """'latest', 'best' or a step number -> an existing step, or a CheckpointError that says what exists."""
    steps = list_steps(model_tag)
    if not steps:
        raise CheckpointError(f"no checkpoint found for model tag {model_tag!r} under {model_dir(model_tag)}; "
                              f"train one first (python -m scripts.base_train --model_tag={model_tag}) or check "
                              f"NANOCHAT_BASE_DIR")
    if which in (None, "latest"):
        return steps[-1]
    if which == "best":
        step = best_step(model_tag)
        if step is None:
            raise CheckpointError(f"no checkpoint of {model_tag!r} has a validation bpb yet; use 'latest'")
        return step
    if not str(which).isdigit():
        raise CheckpointError(f"step {which!r}: use 'latest', 'best' or a step number")
    if int(which) not in steps:
        raise CheckpointError(f"no checkpoint at step {int(which)} for {model_tag!r}; available steps: {steps}")
    return int(which)


def latest_model_tag():
    tags = [t for t in os.listdir(checkpoints_root()) if list_steps(t)] if os.path.isdir(checkpoints_root()) else []
    if not tags:
        raise CheckpointError(f"no checkpoints under {checkpoints_root()}; train a model first "
                              f"(python -m scripts.base_train)")
    return max(tags, key=lambda t: os.path.getmtime(step_dir(t, list_steps(t)[-1])))


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


def check_tokenizer(meta, tokenizer, what):
    """Refuse a checkpoint trained with another tokenizer: the same ids would mean different text."""
    from nanochat.tokenizer import tokenizer_dir
    saved, current = meta.get("tokenizer_fingerprint"), tokenizer.fingerprint()
    if saved is None:
        print0(f"WARNING: {what} records no tokenizer fingerprint (it predates them), so nothing checks that "
               f"{tokenizer_dir()} is the tokenizer it was trained with")
    elif saved != current:
        raise CheckpointError(f"{what} was trained with tokenizer {saved}, but {tokenizer_dir()} holds tokenizer "
                              f"{current} (retrained since?), so token ids would mean other text: restore the tokenizer "
                              f"it was trained with, or train a new model (a new --model_tag) with this one")


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


def check_data_positions(point, args, rank, tokenizer):
    """Refuse, on every rank, a checkpoint whose data positions the current shards do not hold: one line before
    anything is written, rather than the loader's traceback after 'resumed'. Opens this process's train loaders
    at their saved positions, as base_train does, so the loader's own rule decides."""
    from nanochat.dataset import DatasetError
    from nanochat.train_config import training_loaders
    error = None
    try:
        training_loaders(args, tokenizer, rank, point.rank_state["loaders"])
    except ValueError as e:
        error = CheckpointError(f"the data position saved in step {point.step} is not in the current data ({e}); "
                                f"restore the data it was trained on, or start a new --model_tag")
    except DatasetError as e:  # every rank must learn of it
        error = e
    raise_if_any_rank_failed(error, "checking the data positions")


def report_schedule_change(point, schedule, horizon_source):
    """Say, in one line, how this run's learning-rate schedule differs from the checkpoint's (nothing when it does
    not): resuming with a longer horizon is how a run is extended, but it moves the warmdown and so the lr.
    schedule: (num_iterations, warmup_steps, warmdown_ratio, final_lr_frac), train_config.lr_multiplier's arguments."""
    from nanochat.train_config import lr_multiplier
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


# ---------------------------------------------------------------------------------------------------- saving
def rng_state():
    """Every generator's state as tensors and plain data: numpy's key array as a list, so that rank files load with
    weights_only=True."""
    name, keys, *rest = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, keys.tolist(), *rest), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]  # keys: a list, or an ndarray in rank files written before lists
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu())  # torch only takes CPU byte tensors, whatever the run's device
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def checkpoint_bytes(model):
    """Estimated bytes of one checkpoint: the weights, plus optimizer state of at most two tensors per weight
    (AdamW's moments; Muon keeps one). Works on a meta-device model."""
    return 3 * sum(t.numel() * t.element_size() for t in model.state_dict().values())


def free_bytes(path):
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def gigabytes(n):
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def disk_room_problem(model_tag, per_checkpoint, keep_last):
    """None, or why the disk cannot hold the checkpoints --keep_last keeps (the newest K, the best, one being
    written); --keep_last=0 keeps all, and only room for two is checked."""
    copies = keep_last + 2 if keep_last > 0 else 2
    need = max(0, copies - len(list_steps(model_tag))) * per_checkpoint
    free = free_bytes(model_dir(model_tag))
    if need <= free:
        return None
    return (f"not enough disk for checkpoints: each is ~{gigabytes(per_checkpoint)} and --keep_last={keep_last} keeps "
            f"up to {copies} (the newest, the best and one being written), ~{gigabytes(need)} more, but "
            f"{gigabytes(free)} are free under {checkpoints_root()}: free space, lower "
            f"--keep_last, or set NANOCHAT_BASE_DIR to a bigger disk")


def _write(path, data):
    """Write bytes or a torch object, flushed to the disk before the directory is renamed into place."""
    with open(path, "wb") as f:
        if isinstance(data, bytes):
            f.write(data)
        else:
            torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())


def _out_of_space(error, directory, need):
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left" in str(error) \
        or free_bytes(directory) < need


def save_checkpoint(model_tag, step, model, optimizers, meta, rank_state, rank=0, train_model=None):
    """Every rank calls this. rank_state: this rank's dataloader state (and anything else per-rank). model: the
    weights to publish (those evaluated and sampled); train_model: the weights training goes on from, when they
    differ (an EMA is published).

    A failure on any rank removes the partial save and raises CheckpointError on every rank; a full disk says so,
    with the bytes a checkpoint needs."""
    from safetensors.torch import save as safetensors_bytes
    from nanochat import sharding
    final, tmp = step_dir(model_tag, step), step_dir(model_tag, step) + ".tmp"
    sharded = sharding.is_sharded(model)
    need = checkpoint_bytes(model)

    def together(what, work, rank0_only=False):
        if rank0_only:  # the others wait in short collectives: writing the weights may outlast the group's timeout
            error = run_on_rank0(work, rank)
        else:
            error = None
            try:
                work()
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
                error = e
        if error is not None and _out_of_space(error, model_dir(model_tag), need):
            error = OSError(errno.ENOSPC, "no space left on device")
        try:
            raise_if_any_rank_failed(error, f"saving step {step} ({what})")
        except RankFailure as failure:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            advice = (f"; a checkpoint needs ~{gigabytes(need)} ({need:,} bytes), "
                      f"{gigabytes(free_bytes(model_dir(model_tag)))} are free: free space, lower --keep_last or set "
                      f"NANOCHAT_BASE_DIR to a bigger disk, then --resume"
                      if "no space left" in str(failure) else "; fix the cause, then --resume")
            raise CheckpointError(f"{failure}. The partial save was removed and earlier checkpoints are intact"
                                  f"{advice}") from failure

    def prepare():
        if rank == 0:
            os.makedirs(model_dir(model_tag), exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed mid-save
            os.makedirs(tmp)

    def publish():
        for name, module in ((WEIGHTS, model), (TRAIN_WEIGHTS, train_model)):
            if module is not None and not sharded:
                weights = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
                _write(os.path.join(tmp, name), safetensors_bytes(weights))
        _write(os.path.join(tmp, "meta.json"), json.dumps({**meta, "step": step}, indent=2).encode())
        fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step (e.g. after resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(model_dir(model_tag))

    rank_file = os.path.join(tmp, f"rank_{rank}.pt")
    together("preparing the directory", prepare)
    together(f"writing {os.path.basename(rank_file)}",
             lambda: _write(rank_file, {"rng": rng_state(), **rank_state} if sharded else
                            {"optimizers": [opt.state_dict() for opt in optimizers], "rng": rng_state(), **rank_state}))
    if sharded:
        together("writing the shards", lambda: write_shards(tmp, model, train_model, optimizers))
    together("writing the model and meta.json", publish, rank0_only=True)
    return final


def write_shards(directory, model, train_model, optimizers):
    """Every rank writes its shards of the weights and optimizer state (and rank 0 the index, .metadata)."""
    import torch.distributed.checkpoint as dcp
    from nanochat import sharding
    dcp.save(sharding.checkpoint_state(model, train_model, optimizers), checkpoint_id=directory)
    for name in os.listdir(directory):  # DCP flushes but does not fsync: the rename must find them on the disk
        if name.endswith(".distcp") or name == SHARD_INDEX:
            with open(os.path.join(directory, name), "rb") as f:
                os.fsync(f.fileno())


def remove_partial_saves(model_tag):
    """Remove step_N.tmp directories left by a process killed mid-save: they block nothing but hold disk."""
    removed = []
    for path in sorted(glob.glob(os.path.join(model_dir(model_tag), "step_*.tmp"))):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(os.path.basename(path))
    if removed:
        print0(f"removed {', '.join(removed)}: incomplete save(s) of an interrupted run")


def prune_checkpoints(model_tag, keep_last):
    """Keep the newest keep_last checkpoints and the best one by final-step validation bpb."""
    removed = steps_to_prune(readable_bpb(model_tag), keep_last)
    for s in removed:
        shutil.rmtree(step_dir(model_tag, s))
    return removed


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


# ---------------------------------------------------------------------------------------------------- loading
def load_model_weights(model_tag, step, device, name=WEIGHTS):
    """The state dict of a checkpoint: model.safetensors, or model.pt in checkpoints that predate it; with
    name=TRAIN_WEIGHTS the weights training goes on from (None when they are the published ones)."""
    directory = step_dir(model_tag, step)
    path = os.path.join(directory, name)
    try:
        if os.path.exists(os.path.join(directory, SHARD_INDEX)):
            path = os.path.join(directory, SHARD_INDEX)
            return read_shards(directory, "train_model" if name == TRAIN_WEIGHTS else "model", device)
        if os.path.exists(path):
            from safetensors.torch import load_file
            return load_file(path, device=str(device))
        if name == TRAIN_WEIGHTS:
            return None
        path = os.path.join(directory, LEGACY_WEIGHTS)
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated file raises whatever its reader raises
        raise CheckpointError(unreadable(path, e)) from e


def read_shards(directory, part, device="cpu"):
    """One part ('model', 'train_model') of a sharded checkpoint as a whole state dict, in this process alone (no
    process group): the index gives every tensor's shape and dtype. None when the checkpoint has no such part."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    prefix = part + "."
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype, device=device)
             for key, meta in shard_reader(directory).read_metadata().state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not state:
        return None
    with warnings.catch_warnings():  # DCP warns that it reads in one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_shards(state, directory, no_dist=True)
    return {key[len(prefix):]: value for key, value in state.items()}


NO_CHECKPOINT_DOES = "which no checkpoint does"  # in every refusal of a crafted file: --resume stops, never skips


class RefusedObject(pickle.UnpicklingError):
    """A checkpoint file names a Python object no checkpoint holds; the message is that object."""


def refused_object(error):
    """What a loader refused to build (RefusedObject's name, or the gist of torch's multi-line weights_only
    message), or None when the error is of another kind (a truncated file)."""
    if isinstance(error, RefusedObject):
        return str(error)
    text = str(error)
    if not isinstance(error, pickle.UnpicklingError) or "WeightsUnpickler error:" not in text:
        return None
    gist = next(line for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() + ["?"] if line.strip())
    return gist.strip().removeprefix("Unsupported global: GLOBAL ").split(" was not an allowed global")[0]


def unreadable(path, error):
    """One line on a checkpoint file that failed to load: a refused object is said to be one, not damage."""
    refused = refused_object(error)
    if refused is None:
        return f"{path} is unreadable ({describe_error(error)})"
    return (f"{path} holds something other than tensors and plain data ({refused}), {NO_CHECKPOINT_DOES}, so it was "
            f"not read: the file was altered or is not a checkpoint; restore the checkpoint from a copy you trust, "
            f"or use another step")


# Rank files written before rng_state saved numpy's keys as a list hold a numpy array: numpy's own reconstruction of
# an array and its dtype, which build data and call nothing else (numpy 1 and 2 pickle the function under two names).
_reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]
LEGACY_RANK_GLOBALS = [(_reconstruct, f"{module}._reconstruct")
                       for module in ("numpy.core.multiarray", "numpy._core.multiarray")] + [
    np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rank_state(model_tag, step, rank):
    """A rank's optimizer states, loader positions and RNG states, on the CPU: RNG states must stay there, and
    Optimizer.load_state_dict moves each state tensor to its parameter's device. weights_only: a crafted rank file
    would otherwise run code on --resume."""
    path = os.path.join(step_dir(model_tag, step), f"rank_{rank}.pt")
    try:
        with torch.serialization.safe_globals(LEGACY_RANK_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated file raises whatever its reader raises
        raise CheckpointError(unreadable(path, e)) from e


# What torch.distributed.checkpoint pickles into a sharded checkpoint's index (.metadata), by module; torch dtypes
# (torch.float32, ...) are admitted by type in ShardIndexUnpickler.
SHARD_INDEX_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                                              "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout (torch.strided) by its name
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # Python >= 3.13
    "collections": {"OrderedDict"},
}


class ShardIndexUnpickler(pickle.Unpickler):
    """Unpickles a sharded checkpoint's .metadata admitting only the classes DCP writes there (SHARD_INDEX_GLOBALS)
    and torch dtypes: anything else, such as the os.system a crafted index names to run code, is a RefusedObject."""

    def find_class(self, module, name):
        if name in SHARD_INDEX_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # vars: no lazy imports
            return vars(torch)[name]
        raise RefusedObject(f"{module}.{name}")


@functools.cache
def _safe_shard_classes():
    """(reader, planner) classes over torch.distributed.checkpoint's, defined when a sharded checkpoint is first read:
    importing DCP costs seconds that loading a safetensors checkpoint need not pay."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Reader(FileSystemReader):
        """FileSystemReader whose read_metadata unpickles the index with ShardIndexUnpickler: DCP's own calls
        pickle.load, so a crafted .metadata in a run directory (or a restored backup) would run code when read."""

        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = ShardIndexUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise RefusedObject(f"a {type(metadata).__name__} where DCP's Metadata belongs")
            if metadata.storage_meta is None:  # as DCP's own reader does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        """DefaultLoadPlanner whose non-tensor values (AdamW's step) load with weights_only=True: DCP's own
        load_bytes unpickles them with weights_only=False, so a crafted .distcp file would run code."""

        def load_bytes(self, read_item, value):
            try:
                plain = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise RefusedObject(f"{refused_object(e)}, in {read_item.dest_index.fqn}'s value in a .distcp "
                                    f"file") from e
            # DCP's load_bytes puts the value in place; what it reads again is only what weights_only built
            again = io.BytesIO()
            torch.save(plain, again)
            again.seek(0)
            super().load_bytes(read_item, again)

    return Reader, Planner


def shard_reader(directory):
    """A torch.distributed.checkpoint reader of directory that refuses any object but DCP's own in its index."""
    return _safe_shard_classes()[0](directory)


def shard_planner():
    """A torch.distributed.checkpoint load planner that refuses any object but plain data in a saved value."""
    return _safe_shard_classes()[1]()


def load_shards(state, directory, **kwargs):
    """dcp.load of state from directory through shard_reader and shard_planner. DCP's CheckpointException (a
    BaseException whose message is every rank's traceback) is raised as its first rank's own error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        dcp.load(state, storage_reader=shard_reader(directory), planner=shard_planner(), **kwargs)
    except CheckpointException as e:
        raise next(iter(e.failures.values()))[0] from e


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
    this rank's (train_config.data_ranks), whose loader positions a sharded checkpoint gives from any saving process.

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
    import torch.distributed.checkpoint as dcp
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
    from nanochat import sharding
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


def build_model(config_dict, device):
    config = GPTConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()  # fills the rotary buffers; the weights are overwritten by the checkpoint
    return model


def load_model(model_tag=None, step="latest", device="cpu", **config_overrides):
    """(model in eval mode, tokenizer, meta) from a checkpoint; config_overrides e.g. n_sup_inference=2.

    A checkpoint trained with another tokenizer is refused; an unreadable file is named, with the other steps."""
    from nanochat.tokenizer import get_tokenizer

    model_tag = model_tag or latest_model_tag()
    step = resolve_step(model_tag, step)
    try:
        meta = read_meta(model_tag, step)
        weights = load_model_weights(model_tag, step, device)
    except CheckpointError as e:
        others = [s for s in list_steps(model_tag) if s != step]
        raise CheckpointError(f"checkpoint {model_tag} step {step} is damaged: {e}; load another with --step="
                              + (f"{others[-1]} (available: {', '.join(map(str, others))})" if others else
                                 "N (it is the only one: retrain, or restore it from a backup)")) from e
    tokenizer = get_tokenizer()
    check_tokenizer(meta, tokenizer, f"checkpoint {model_tag} step {step}")
    model = build_model({**meta["model_config"], **config_overrides}, device)
    model.load_state_dict(weights)
    model.eval()
    return model, tokenizer, meta


# ---------------------------------------------------------------------------------------------------- backup
class Backup:
    """A copy of the tag's checkpoints at an fsspec URL (gs://, s3://, a local path, memory://).

    start() runs a background thread: submit(step) after each completed local save queues that checkpoint (a newer
    one replaces one still waiting), which is uploaded with meta.json last (a step counts as backed up only once its
    meta.json is there), then retention is applied to the backup too. A failure warns; training never waits."""

    def __init__(self, fs, directory, url, model_tag, keep_last=0):
        self.fs, self.dir, self.url, self.model_tag, self.keep_last = fs, directory, url, model_tag, keep_last
        self.pending, self.busy, self.closed = None, False, False
        self.cond = threading.Condition()
        self.thread = None

    @classmethod
    def location(cls, url, model_tag, keep_last=0):
        import fsspec
        try:
            fs, root = fsspec.core.url_to_fs(url)
        except Exception as e:  # noqa: BLE001 - an unknown protocol, a missing filesystem package, bad options
            raise CheckpointError(f"--backup_dir={url}: {describe_error(e)} (gs:// needs `pip install gcsfs`, s3:// "
                                  f"needs `pip install s3fs`)") from e
        return cls(fs, posixpath.join(root.rstrip("/") or "/", model_tag), url, model_tag, keep_last)

    def remote(self, step, name=""):
        return posixpath.join(self.dir, f"step_{step:06d}", name)

    def steps(self):
        """Steps with a complete copy in the backup, ascending."""
        try:
            paths = self.fs.glob(posixpath.join(self.dir, "step_*", "meta.json"))
        except Exception as e:  # noqa: BLE001 - no access, no network
            raise CheckpointError(f"cannot list the backup {self.url}: {describe_error(e)}") from e
        names = [posixpath.basename(posixpath.dirname(p)) for p in paths]
        return sorted(int(n[5:]) for n in names if n[5:].isdigit())

    def restore(self, which="latest"):
        """Download one checkpoint (the newest, or step `which`) into the local tag directory; returns its step."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"the backup {self.url} holds no checkpoint of {self.model_tag!r}")
        step = steps[-1] if which in (None, "latest") else int(which)
        if step not in steps:
            raise CheckpointError(f"the backup {self.url} has no step {step} of {self.model_tag!r}; it has {steps}")
        final, tmp = step_dir(self.model_tag, step), step_dir(self.model_tag, step) + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for path in self.fs.ls(self.remote(step), detail=False):
            self.fs.get_file(path, os.path.join(tmp, posixpath.basename(path)))
        os.rename(tmp, final)
        print0(f"restored {self.model_tag} step {step} from the backup {self.url}")
        return step

    def start(self):
        self.closed = False
        self.thread = threading.Thread(target=self.work, name="checkpoint-backup", daemon=True)
        self.thread.start()
        return self

    def submit(self, step):
        with self.cond:
            self.pending = step
            self.cond.notify_all()

    def work(self):
        while True:
            with self.cond:
                while self.pending is None and not self.closed:
                    self.cond.wait()
                if self.pending is None:
                    return
                step, self.pending, self.busy = self.pending, None, True
            try:
                self.upload(step)
                self.prune()
                print0(f"backup: step {step} copied to {self.url}")
            except Exception as e:  # noqa: BLE001 - a backup failure must never stop training
                print0(f"WARNING: backup of step {step} to {self.url} failed ({describe_error(e)}); training goes "
                       f"on and the local checkpoint is complete")
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def upload(self, step):
        local = step_dir(self.model_tag, step)
        names = sorted(os.listdir(local), key=lambda name: name == "meta.json")  # meta.json last: marks it complete
        if self.fs.exists(self.remote(step, "meta.json")):  # a re-saved step: never "complete" while half-copied
            self.fs.rm(self.remote(step, "meta.json"))
        self.fs.makedirs(self.remote(step), exist_ok=True)
        for name in names:
            self.fs.put_file(os.path.join(local, name), self.remote(step, name))

    def prune(self):
        bpb = {s: final_val_bpb(json.loads(self.fs.cat_file(self.remote(s, "meta.json")))) for s in self.steps()}
        for s in steps_to_prune(bpb, self.keep_last):
            self.fs.rm(self.remote(s), recursive=True)

    def close(self, timeout=BACKUP_EXIT_WAIT_S):
        """Wait, at most timeout seconds, for an upload in flight or waiting, then end the thread. On rank 0 of a
        distributed run, call it through common.run_on_rank0, so the other ranks wait without nearing the
        process-group timeout."""
        with self.cond:
            if self.pending is not None or self.busy:
                print0(f"waiting (at most {timeout:.0f}s) for the backup to {self.url} to finish")
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout)
        if self.thread.is_alive():
            print0(f"WARNING: the backup to {self.url} did not finish in {timeout:.0f}s; exiting without it (the local "
                   f"checkpoints are complete)")
