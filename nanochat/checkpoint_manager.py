"""
Checkpoints under $NANOCHAT_BASE_DIR/base_checkpoints/<model_tag>/step_NNNNNN/:
    model.pt        model weights (rank 0)
    rank_R.pt       rank R's optimizer state, dataloader position and RNG states
    meta.json       step, effective model config, user flags, val bpb per step, elapsed time and cost

A checkpoint is written into step_NNNNNN.tmp/ and the directory is renamed into place only when every file is
complete and fsynced, so a process killed mid-save leaves the previous checkpoint intact and loadable.
"""

import glob
import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from nanochat.common import fsync_dir, get_base_dir
from nanochat.gpt import GPT, GPTConfig

# Fields that may differ between a checkpoint and the run resuming it: they change no weight and no training math.
RESUMABLE_CONFIG_CHANGES = {"n_sup_inference", "activation_checkpointing"}


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
    with open(os.path.join(step_dir(model_tag, step), "meta.json")) as f:
        return json.load(f)


def final_val_bpb(meta):
    bpb = meta.get("val_bpb")
    return bpb[-1] if bpb else None


def best_step(model_tag):
    """The step whose final-step validation bpb is lowest (the best checkpoint is often not the last)."""
    scored = [(final_val_bpb(read_meta(model_tag, s)), s) for s in list_steps(model_tag)]
    scored = [(bpb, s) for bpb, s in scored if bpb is not None]
    return min(scored)[1] if scored else None


def resolve_step(model_tag, which):
    """'latest', 'best' or a step number -> an existing step, or a ValueError that says what exists."""
    steps = list_steps(model_tag)
    if not steps:
        raise ValueError(f"no checkpoint found for model tag {model_tag!r} under {model_dir(model_tag)}; "
                         f"train one first (python -m scripts.base_train --model_tag={model_tag}) or check "
                         f"NANOCHAT_BASE_DIR")
    if which in (None, "latest"):
        return steps[-1]
    if which == "best":
        step = best_step(model_tag)
        if step is None:
            raise ValueError(f"no checkpoint of {model_tag!r} has a validation bpb yet; use 'latest'")
        return step
    step = int(which)
    if step not in steps:
        raise ValueError(f"no checkpoint at step {step} for {model_tag!r}; available steps: {steps}")
    return step


def latest_model_tag():
    tags = [t for t in os.listdir(checkpoints_root()) if list_steps(t)] if os.path.isdir(checkpoints_root()) else []
    if not tags:
        raise ValueError(f"no checkpoints under {checkpoints_root()}; train a model first (python -m scripts.base_train)")
    return max(tags, key=lambda t: os.path.getmtime(step_dir(t, list_steps(t)[-1])))


def config_differences(saved, current):
    """Names and values of model-config fields that differ in a way that makes resuming wrong."""
    return [f"{k}: checkpoint {saved.get(k)!r} vs this run {current.get(k)!r}"
            for k in sorted(set(saved) | set(current))
            if k not in RESUMABLE_CONFIG_CHANGES and saved.get(k) != current.get(k)]


def rng_state():
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_torch(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_checkpoint(model_tag, step, model, optimizers, meta, rank_state, rank=0):
    """Every rank calls this. rank_state: this rank's dataloader state (and anything else per-rank)."""
    final, tmp = step_dir(model_tag, step), step_dir(model_tag, step) + ".tmp"
    if rank == 0:
        os.makedirs(model_dir(model_tag), exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed mid-save
        os.makedirs(tmp)
    _barrier()
    _save_torch({"optimizers": [opt.state_dict() for opt in optimizers], "rng": rng_state(), **rank_state},
                os.path.join(tmp, f"rank_{rank}.pt"))
    _barrier()
    if rank == 0:
        _save_torch(model.state_dict(), os.path.join(tmp, "model.pt"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "step": step}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step (e.g. after resume): swap, never leave neither
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(model_dir(model_tag))
    _barrier()
    return final


def load_rank_state(model_tag, step, rank, device):
    return torch.load(os.path.join(step_dir(model_tag, step), f"rank_{rank}.pt"), map_location=device,
                      weights_only=False)


def load_model_weights(model_tag, step, device):
    return torch.load(os.path.join(step_dir(model_tag, step), "model.pt"), map_location=device, weights_only=True)


def prune_checkpoints(model_tag, keep_last):
    """Keep the newest keep_last checkpoints and the best one by final-step validation bpb."""
    if keep_last <= 0:
        return []
    steps = list_steps(model_tag)
    keep = set(steps[-keep_last:]) | {best_step(model_tag)}
    removed = [s for s in steps if s not in keep]
    for s in removed:
        shutil.rmtree(step_dir(model_tag, s))
    return removed


def build_model(config_dict, device):
    config = GPTConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()  # fills the rotary buffers; the weights are overwritten by the checkpoint
    return model


def load_model(model_tag=None, step="latest", device="cpu", **config_overrides):
    """(model in eval mode, tokenizer, meta) from a checkpoint; config_overrides e.g. n_sup_inference=2."""
    from nanochat.tokenizer import get_tokenizer

    model_tag = model_tag or latest_model_tag()
    step = resolve_step(model_tag, step)
    meta = read_meta(model_tag, step)
    model = build_model({**meta["model_config"], **config_overrides}, device)
    model.load_state_dict(load_model_weights(model_tag, step, device))
    model.eval()
    return model, get_tokenizer(), meta
