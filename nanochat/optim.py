"""One optimizer step for the model's optimizers, with gradient clipping on the true (averaged) gradient."""

import math

import torch
import torch.distributed as dist


def squared_norm(tensors):
    """The sum of squares of all elements of tensors, in float32: the optimizers' share of the gradient norm."""
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]).square().sum()


@torch.no_grad()
def clip_and_step(optimizers, grad_clip):
    """Average gradients across ranks, clip their global norm to grad_clip (<= 0: no clipping), step.

    Returns the gradient norm before clipping; a non-finite norm skips the update. Under DDP each rank holds a
    disjoint share of the averaged gradients after reduce_grads(), so summing the shares' squared norms across ranks
    gives the exact global norm, the same number a single process computes on the same averaged gradient. The clip
    scale enters the momentum before orthogonalisation, so no update can start before every gradient is reduced.
    """
    sq = sum(opt.reduce_grads() for opt in optimizers)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sq)
    grad_norm = sq.sqrt().item()
    if not math.isfinite(grad_norm):  # never write NaN/Inf into the weights; the caller decides what to do
        return grad_norm
    scale = min(1.0, grad_clip / (grad_norm + 1e-6)) if grad_clip > 0 else 1.0
    for opt in optimizers:
        opt.step(grad_scale=scale)
    return grad_norm
