"""One optimizer step for the model's optimizers, with gradient clipping on the true (averaged) gradient."""

import math

import torch
from torch.distributed.tensor import DTensor


def local(t):
    """This rank's part of a tensor sharded by FSDP (a DTensor); any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def squared_norm(tensors):
    """The sum of squares of all elements of tensors (of this rank's shards, under FSDP), in float32: the optimizers'
    share of the gradient norm."""
    return torch.stack([torch.linalg.vector_norm(local(t), dtype=torch.float32) for t in tensors]).square().sum()


class LocalGradients:
    """reduce_grads of the single-process optimizers (AdamW, Muon): the gradients are already the averaged ones."""

    @torch.no_grad()
    def reduce_grads(self):
        return squared_norm(p.grad for g in self.param_groups for p in g["params"])


@torch.no_grad()
def reduce_gradients(optimizers):
    """Average the gradients across ranks; returns this rank's share of the squared global norm, on the device.

    Under DDP each rank holds a disjoint share of the averaged gradients after reduce_grads(), so summing the shares'
    squared norms across ranks gives the exact global norm, the same number a single process computes on the same
    averaged gradient. Under FSDP the gradients arrive averaged and sharded (the backward reduce-scatters them): each
    rank's share is its shards."""
    return sum(opt.reduce_grads() for opt in optimizers)


@torch.no_grad()
def clipped_step(optimizers, grad_norm, grad_clip):
    """Step with the gradients scaled so their global norm is at most grad_clip (<= 0: no clipping). A non-finite
    norm skips the update: never write NaN/Inf into the weights; the caller decides what to do. The clip scale
    enters the momentum before orthogonalisation, so no update can start before every gradient is reduced."""
    if not math.isfinite(grad_norm):
        return
    scale = min(1.0, grad_clip / (grad_norm + 1e-6)) if grad_clip > 0 else 1.0
    for opt in optimizers:
        opt.step(grad_scale=scale)
