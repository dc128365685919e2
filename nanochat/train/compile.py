"""
What torch.compile compiles for training, and how: regional compilation of the model's repeated pieces, so compile
time does not grow with the recursion.

Scopes: "layer", one layer visit serving every layer, loop, sweep and supervision step (compile time flat in the depth
and the recursion); "model", the embedding and each whole sweep (every layer visit) as one region each, so the residual
stream is fused across layers (for a plain GPT the sweep is the whole trunk, as nanochat compiles its model). The
training head's chunk is one region in both. The model calls a compiled twin where one is set (GPT._visit_layer,
_sweep, embed, step_loss) and runs eagerly otherwise (cached sampling, activation checkpointing's recompute).
"""

import functools

import torch

from nanochat.model.gpt import embed_tokens, sweep_layers, visit_layer
from nanochat.model.supervision import normed_head_chunk_loss_and_grads

COMPILE_SCOPES = ("layer", "model")


def compile_scope_for(config, requested="auto", fsdp=False):
    """(scope, why): auto is "model" for a plain GPT (n_loops=0) and "layer" for the recursion, whose sweeps unrolled
    would compile n_layer*(n_loops+1) blocks; FSDP gathers a block per layer visit and activation checkpointing
    recomputes one, so both keep "layer"."""
    if requested == "auto":
        why = ("FSDP" if fsdp else "activation checkpointing" if config.activation_checkpointing else
               "the recursion" if config.n_loops else None)
        return ("layer", f"auto: the layer visit ({why})") if why else ("model", "auto: the whole model (a plain GPT)")
    if requested not in COMPILE_SCOPES:
        raise ValueError(f"compile scope {requested!r} is unknown; choose auto or one of {COMPILE_SCOPES}")
    if requested == "model" and (fsdp or config.activation_checkpointing):
        raise ValueError("compile scope model compiles whole sweeps, but FSDP gathers and activation checkpointing "
                         "recomputes one layer visit at a time: use --compile_scope=layer (or auto)")
    return requested, "asked"


def compile_regions(model, scope="layer", backend="inductor"):
    """Set model's compiled twins for `scope`. Calls with gradient and calls without (evaluation, the no-gradient
    sweeps) each get their own twin, so neither recompiles the other's graph. The training loss's head chunk is
    compiled too: fused, its norm, softcap and cross-entropy read the logits once."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope {scope!r} is unknown; choose one of {COMPILE_SCOPES}")
    compile = functools.partial(torch.compile, dynamic=False, backend=backend)
    if scope == "layer":
        model._compiled_visit, model._compiled_eval_visit = compile(visit_layer), compile(visit_layer)
    else:
        model._compiled_sweep, model._compiled_eval_sweep = compile(sweep_layers), compile(sweep_layers)
        model._compiled_embed = compile(embed_tokens)
    model._compiled_head_chunk = compile(functools.partial(normed_head_chunk_loss_and_grads, fusable=True))
