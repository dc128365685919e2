"""
AdamW for the embedding and lm_head, and DistAdamW, its ZeRO-1 sharded form: each DDP rank keeps the optimizer
state for and updates only its 1/world_size slice of every parameter.

The update is written out here (rather than using torch.optim.AdamW) so the single-process and sharded optimizers
share one formula and give the same parameters on the same averaged gradients.
"""

import torch
import torch.distributed as dist

from nanochat.optim import LocalGradients, squared_norm


def new_adamw_state(like):
    """A parameter's AdamW state before its first update; like: its gradient (or the parameter: same shape)."""
    return {"step": 0, "exp_avg": torch.zeros_like(like), "exp_avg_sq": torch.zeros_like(like)}


def adamw_update(param, grad, state, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    if not state:
        state.update(new_adamw_state(grad))
    state["step"] += 1
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].lerp_(grad.square(), 1 - beta2)
    bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    denom = (state["exp_avg_sq"] / bias2).sqrt_().add_(eps)
    param.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)


class AdamW(LocalGradients, torch.optim.Optimizer):
    """Single-process AdamW. Call reduce_grads() (returns the squared gradient norm, for clipping), then step()."""

    def __init__(self, param_groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @staticmethod
    def new_state(p):
        return new_adamw_state(p)

    @torch.no_grad()
    def step(self, grad_scale=1.0):
        for group in self.param_groups:
            for p in group["params"]:
                adamw_update(p, p.grad * grad_scale, self.state[p], group["lr"], group["betas"], group["eps"],
                             group["weight_decay"])


class DistAdamW(AdamW):
    """ZeRO-1 AdamW: reduce-scatter each flattened gradient (zero-padded to a multiple of world_size), update the
    owned slice, all-gather the parameter. Any shape works, divisible or not.

    Collectives are asynchronous, as in DistMuon: every reduce-scatter starts at once in reduce_grads(), and each
    all-gather starts as soon as its slice is updated, running while the next slices are.
    """

    @torch.no_grad()
    def reduce_grads(self):
        world = dist.get_world_size()
        self._shards, works = [], []  # (param, group, averaged grad slice, padded flat length)
        for group in self.param_groups:
            for p in group["params"]:
                padded_len = -(-p.numel() // world) * world
                flat = torch.zeros(padded_len, dtype=p.grad.dtype, device=p.device)
                flat[:p.numel()] = p.grad.reshape(-1)
                shard = torch.empty(padded_len // world, dtype=flat.dtype, device=p.device)
                works.append(dist.reduce_scatter_single(shard, flat, op=dist.ReduceOp.AVG, async_op=True))
                self._shards.append((p, group, shard, padded_len))
        for work in works:
            work.wait()
        return squared_norm(shard for _, _, shard, _ in self._shards)

    @torch.no_grad()
    def step(self, grad_scale=1.0):
        rank, world = dist.get_rank(), dist.get_world_size()
        gathers = []
        for p, group, grad_shard, padded_len in self._shards:
            flat = torch.zeros(padded_len, dtype=p.dtype, device=p.device)
            flat[:p.numel()] = p.reshape(-1)
            size = padded_len // world
            shard = flat[rank * size:(rank + 1) * size].clone()
            adamw_update(shard, grad_shard * grad_scale, self.state[p], group["lr"], group["betas"], group["eps"],
                         group["weight_decay"])
            gathers.append((p, flat, dist.all_gather_single(flat, shard, async_op=True)))
        for p, flat, work in gathers:
            work.wait()
            p.copy_(flat[:p.numel()].view_as(p))
        self._shards = []
