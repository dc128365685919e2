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
rank raises CheckpointError (nanochat/checkpoint/writer.py writes it). A .tmp left by a kill is removed by the next
run of the tag.

Retention keeps the newest K and the best. Whether a run may start on a tag or continue a checkpoint is
nanochat/checkpoint/resume.py's; the copy at a backup URL, nanochat/checkpoint/backup.py's.

No file of a checkpoint can run code when read, so a checkpoint from a backup or another machine is only data: weights
are safetensors, rank files load with torch.load(weights_only=True), and a sharded checkpoint is read through
nanochat/checkpoint/safe_load.py's shard_reader and shard_planner. A file holding anything else is refused in one line
naming what it holds. The model a checkpoint's config builds is build_model's; the RNG states a rank file
holds, common.rng_state's.
"""

import glob
import json
import os
import shutil
import warnings
from typing import NamedTuple

import torch
from safetensors.torch import load_file

from nanochat.checkpoint.meta import best_of, final_val_bpb, meta_problem, steps_to_prune
from nanochat.checkpoint.safe_load import LEGACY_RANK_GLOBALS, NO_CHECKPOINT_DOES, load_shards, shard_reader, unreadable
from nanochat.common import describe_error, print0
from nanochat.data.tokenizer import get_tokenizer, tokenizer_dir
from nanochat.files import checkpoints_root, free_bytes, gigabytes, is_step_number, model_tag_arg, step_arg, tag_problem
from nanochat.model.gpt import GPT, GPTConfig

WEIGHTS, LEGACY_WEIGHTS = "model.safetensors", "model.pt"
SHARD_INDEX = ".metadata"  # a sharded checkpoint's index (torch.distributed.checkpoint); its shards: __R_0.distcp
TRAIN_WEIGHTS = "train_weights.safetensors"  # with --ema_decay: model.safetensors holds the EMA, this what trains on


def build_model(config_dict, device):
    """Build the GPT that config_dict describes on device. Its weights are left uninitialised, because a checkpoint
    overwrites them."""
    config = GPTConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()  # fills the rotary buffers; the weights are overwritten by the checkpoint
    return model


def weights_problem(model, weights):
    """Say why a state dict does not load into model, or return None when it does. Names and shapes are compared;
    no value is touched."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    given = {k: tuple(v.shape) for k, v in weights.items()}
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    wrong = [f"{k} is {list(given[k])}, the config needs {list(shape)}" for k, shape in expected.items()
             if k in given and given[k] != shape]
    parts = ([f"{len(missing)} weight(s) missing ({missing[0]}...)"] if missing else []) + \
        ([f"{len(extra)} unexpected ({extra[0]}...)"] if extra else []) + \
        ([f"{len(wrong)} of another shape ({wrong[0]})"] if wrong else [])
    return "; ".join(parts) or None


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message names the file and what to do."""


def model_dir(model_tag):
    problem = tag_problem(model_tag)
    if problem:
        raise CheckpointError(problem)
    return os.path.join(checkpoints_root(), model_tag)


def step_dir(model_tag, step):
    return os.path.join(model_dir(model_tag), f"step_{step:06d}")


def list_steps(model_tag):
    """The steps that have a complete checkpoint, in ascending order. A checkpoint is complete once its directory
    has its final name and holds meta.json."""
    steps = []
    for path in glob.glob(os.path.join(model_dir(model_tag), "step_*")):
        name = os.path.basename(path)
        if is_step_number(name[5:]) and os.path.exists(os.path.join(path, "meta.json")):
            steps.append(int(name[5:]))
    return sorted(steps)


def read_meta(model_tag, step, checked=True):
    """A checkpoint's meta.json, checked (meta_problem): every reader may index the fields it uses. checked=False:
    the JSON as it is, for a reader of one field that must not skip a checkpoint whose other fields are malformed."""
    path = os.path.join(step_dir(model_tag, step), "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is unreadable ({describe_error(e)})") from e
    problem = meta_problem(meta) if checked else None
    if problem:
        raise CheckpointError(f"{path} is malformed ({problem}): restore it from a copy you trust, or use another "
                              f"step")
    if checked:
        meta.setdefault("step", step)  # the directory's name says it too
    return meta


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


def resolve_step(model_tag, which):
    """Turn 'latest', 'best' or a step number into a step that exists. Otherwise raise a CheckpointError that says
    which steps do exist."""
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
    if not is_step_number(str(which)):
        raise CheckpointError(f"step {which!r}: use 'latest', 'best' or a step number in digits 0-9")
    if int(which) not in steps:
        raise CheckpointError(f"no checkpoint at step {int(which)} for {model_tag!r}; available steps: {steps}")
    return int(which)


def latest_model_tag():
    tags = [t for t in os.listdir(checkpoints_root()) if tag_problem(t) is None and list_steps(t)] \
        if os.path.isdir(checkpoints_root()) else []
    if not tags:
        raise CheckpointError(f"no checkpoints under {checkpoints_root()}; train a model first "
                              f"(python -m scripts.base_train)")
    return max(tags, key=lambda t: os.path.getmtime(step_dir(t, list_steps(t)[-1])))


def check_tokenizer(meta, tokenizer, what):
    """Refuse a checkpoint trained with another tokenizer: the same ids would mean different text."""
    saved, current = meta.get("tokenizer_fingerprint"), tokenizer.fingerprint()
    if saved is None:
        print0(f"WARNING: {what} records no tokenizer fingerprint (it predates them), so nothing checks that "
               f"{tokenizer_dir()} is the tokenizer it was trained with")
    elif saved != current:
        raise CheckpointError(f"{what} was trained with tokenizer {saved}, but {tokenizer_dir()} holds tokenizer "
                              f"{current} (retrained since?), so token ids would mean other text: restore the "
                              f"tokenizer it was trained with, or train a new model (a new --model_tag) with this one")


# ---------------------------------------------------------------------------------------------------- saving
def checkpoint_bytes(model):
    """Estimated bytes of one checkpoint: the weights, plus optimizer state of at most two tensors per weight
    (AdamW's moments; Muon keeps one). Works on a meta-device model."""
    return 3 * sum(t.numel() * t.element_size() for t in model.state_dict().values())


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


def remove_partial_saves(model_tag):
    """Remove step_N.tmp directories left by a process killed mid-save: they block nothing but hold disk."""
    removed, kept = [], []
    for path in sorted(glob.glob(os.path.join(model_dir(model_tag), "step_*.tmp"))):
        try:
            shutil.rmtree(path)
            removed.append(os.path.basename(path))
        except OSError as e:
            kept.append(f"{os.path.basename(path)} ({e.strerror or e})")
    if removed:
        print0(f"removed {', '.join(removed)}: incomplete save(s) of an interrupted run")
    if kept:
        print0(f"WARNING: could not remove {', '.join(kept)}, incomplete save(s) of an interrupted run: they hold disk "
               f"until removed by hand")


def prune_checkpoints(model_tag, keep_last):
    """Keep the newest keep_last checkpoints and the best one by final-step validation bpb."""
    removed = steps_to_prune(readable_bpb(model_tag), keep_last)
    for s in removed:
        shutil.rmtree(step_dir(model_tag, s))
    return removed


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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: DCP costs ~1 s to import
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


def load_model(model_tag=None, step="latest", device="cpu", **config_overrides):
    """Load a checkpoint and return the model in eval mode, the tokenizer and the checkpoint's meta.json.
    config_overrides change fields of the saved config, for example n_sup_inference=2. A checkpoint trained with
    another tokenizer is refused. An unreadable file is named in the error, together with the other steps."""
    model_tag = model_tag or latest_model_tag()
    step = resolve_step(model_tag, step)
    try:
        meta = read_meta(model_tag, step)
        weights = load_model_weights(model_tag, step, device)
    except CheckpointError as e:
        if NO_CHECKPOINT_DOES in str(e):  # an altered file, said so in its own line: not damage
            raise
        others = [s for s in list_steps(model_tag) if s != step]
        raise CheckpointError(f"checkpoint {model_tag} step {step} is damaged: {e}; load another with --step="
                              + (f"{others[-1]} (available: {', '.join(map(str, others))})" if others else
                                 "N (it is the only one: retrain, or restore it from a backup)")) from e
    tokenizer = get_tokenizer()
    check_tokenizer(meta, tokenizer, f"checkpoint {model_tag} step {step}")
    try:
        with torch.device("meta"):  # shapes first: a config that disagrees with the weights allocates nothing
            problem = weights_problem(GPT(GPTConfig.from_dict({**meta["model_config"], **config_overrides})), weights)
    except (TypeError, ValueError, RuntimeError) as e:
        problem = f"its model_config builds no model ({e})"
    if problem:
        raise CheckpointError(f"checkpoint {model_tag} step {step} does not fit together: {problem}; its weights and "
                              f"meta.json come from different models: restore the checkpoint from a copy you trust, "
                              f"or use another step")
    model = build_model({**meta["model_config"], **config_overrides}, device)
    model.load_state_dict(weights)
    model.eval()
    return model, tokenizer, meta


class Checkpoint(NamedTuple):
    """A checkpoint opened for use: the model in eval mode, its tokenizer, its meta.json, and the tag and step it
    was found at (the newest tag and the latest step when none was named)."""
    model: torch.nn.Module
    tokenizer: object
    meta: dict
    model_tag: str
    step: int


def checkpoint_flags(parser, what="the checkpoint to read"):
    """--model_tag and --step, spelled the same in every entry point that reads a checkpoint."""
    parser.add_argument("--model_tag", type=model_tag_arg, default=None,
                        help=f"{what}: a run under base_checkpoints/ (default: the newest)")
    parser.add_argument("--step", type=step_arg, default="latest",
                        help="latest | best (lowest validation bpb) | a step number (default: latest)")


def open_checkpoint(model_tag, step, device, **config_overrides):
    """The Checkpoint that --model_tag and --step name (load_model, with the tag and step resolved)."""
    model_tag = model_tag or latest_model_tag()
    model, tokenizer, meta = load_model(model_tag, step, device, **config_overrides)
    return Checkpoint(model, tokenizer, meta, model_tag, meta["step"])
