"""
What a checkpoint's meta.json may hold, and what is read from it without touching the disk: the shape check every
reader relies on (meta_problem), the final-step validation bpb, the best step and retention's choice. Reading the file
is checkpoint_manager.read_meta's; this module is plain data in, answers out, so backup.py applies the same rules to
a remote copy.
"""

import json
import math

from nanochat.model.gpt import GPTConfig


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _text(value):
    return isinstance(value, str)


def _optional(check):
    return lambda value: value is None or check(value)


def _record(**fields):
    """A check of an object whose listed fields, where present, pass their checks."""
    return lambda value: isinstance(value, dict) and all(check(value[k]) for k, check in fields.items() if k in value)


# What readers of meta.json index, and the shape they need (the rest, such as user_flags, is only reported).
# Checked by hand: pydantic, which would do it, is only installed with the server's extras.
META_FIELDS = {
    "step": _int,
    "val_bpb": _optional(lambda v: isinstance(v, list) and all(_optional(_number)(x) for x in v)),
    "tokenizer_fingerprint": _optional(_text),
    "data": _optional(_record(fingerprint=_text, shards=_int, dir=_text)),
    "batch_geometry": _record(world_size=_int, grad_accum=_int, device_batch_size=_int, max_seq_len=_int),
    "train_config": _record(sharding=_text, warmdown_ratio=_optional(_number), final_lr_frac=_optional(_number)),
    "num_iterations": _optional(_int),
    "warmup_steps": _optional(_int),
    "elapsed_seconds": _number,
    "early_stop": _optional(_record(stale=_int, last_step=_optional(_int), best=_optional(
        lambda v: isinstance(v, list) and len(v) == 2 and _int(v[0]) and _number(v[1])))),
    "halt_train": _record(**{"from": _text}),
}
# Sizes the weights' shapes do not bound, so a crafted meta.json could make loading allocate or build without end;
# each far above any model this code trains (a 1M-token context, thousands of layers or steps).
CONFIG_LIMITS = {"sequence_len": 1 << 20, **{k: 4096 for k in ("n_layer", "n_head", "n_kv_head", "n_loops",
                                                                "T_recursion", "n_sup_train", "n_sup_inference",
                                                                "n_prelude", "n_coda")}}
META_REQUIRED = {"data": ("fingerprint", "shards", "dir"), "halt_train": ("from",), "early_stop": ("best", "stale",
                                                                                                      "last_step")}


def meta_problem(meta):
    """What is wrong with a meta.json's content, in words, or None."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__} where an object belongs"
    config = meta.get("model_config")
    if not isinstance(config, dict):
        return "model_config is missing" if config is None else \
            f"model_config is a {type(config).__name__}, not an object"
    try:
        GPTConfig.from_dict(config)
    except (TypeError, ValueError) as e:
        return f"model_config: {e}"
    too_large = next((k for k, most in CONFIG_LIMITS.items() if _int(config.get(k)) and config[k] > most), None)
    if too_large:
        return f"model_config.{too_large}={config[too_large]} exceeds {CONFIG_LIMITS[too_large]:,}"
    for name, check in META_FIELDS.items():
        if name in meta and not check(meta[name]):
            return f"{name} is {json.dumps(meta[name])[:80]}, which is not what a checkpoint writes there"
        missing = [k for k in META_REQUIRED.get(name, ()) if isinstance(meta.get(name), dict) and k not in meta[name]]
        if missing:
            return f"{name} lacks {', '.join(missing)}"
    return None


def final_val_bpb(meta):
    bpb = meta.get("val_bpb")
    return bpb[-1] if bpb else None


def best_of(bpb_by_step):
    """The step whose final-step validation bpb is lowest, or None when none has one."""
    scored = [(bpb, step) for step, bpb in bpb_by_step.items() if bpb is not None]
    return min(scored)[1] if scored else None


def steps_to_prune(bpb_by_step, keep_last):
    """Retention: every step but the newest keep_last and the best by final-step validation bpb (0 keeps all)."""
    if keep_last <= 0:
        return []
    steps = sorted(bpb_by_step)
    keep = set(steps[-keep_last:]) | {best_of(bpb_by_step)}
    return [s for s in steps if s not in keep]
