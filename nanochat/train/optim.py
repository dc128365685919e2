"""
The optimizers, top to bottom: the gradient-norm helpers, AdamW (embedding, lm_head, scalars) and its ZeRO-1 form
DistAdamW, Muon (the transformer matrices) with DistMuon under DDP and ShardedMuon under FSDP, the model's parameter
groups (setup_optimizers), one training step's gradient reduce and clipped update, and the schedules (learning rate
and Muon's momentum by step).

Every optimizer has the same two calls: reduce_grads() averages the gradients across ranks (if any) and returns this
rank's share of the squared global norm; step(grad_scale) updates with the gradients scaled for clipping.
"""

import functools
import math
import sys

import torch
import torch.distributed as dist

from nanochat.collectives import all_gather_single, all_to_all, reduce_scatter_single
from nanochat.common import distributed


# ---------------------------------------------------------------------------------------------------- norms
def local(t):
    """This rank's part of a tensor sharded by FSDP (a DTensor); any other tensor itself."""
    # no DTensor exists before FSDP imports torch.distributed.tensor: its ~0.9 s of start-up is spared every process
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def squared_norm(tensors):
    """The sum of squares of all elements of tensors (of this rank's shards, under FSDP), in float32: the optimizers'
    share of the gradient norm."""
    return torch.stack([torch.linalg.vector_norm(local(t), dtype=torch.float32) for t in tensors]).square().sum()


class LocalGradients:
    """reduce_grads of the single-process optimizers (AdamW, Muon): the gradients are already the averaged ones."""

    @torch.no_grad()
    def reduce_grads(self):
        return squared_norm(p.grad for g in self.param_groups for p in g["params"])


# ---------------------------------------------------------------------------------------------------- AdamW
# The update is written out here (rather than using torch.optim.AdamW) so the single-process and sharded optimizers
# share one formula and give the same parameters on the same averaged gradients.

def new_adamw_state(like):
    """A parameter's AdamW state before its first update; like: its gradient (or the parameter: same shape)."""
    return {"step": 0, "exp_avg": torch.zeros_like(like), "exp_avg_sq": torch.zeros_like(like)}


def adamw_update(params, grads, states, lr, betas, eps, weight_decay):
    """AdamW on lists of parameters, their gradients and states, through torch._foreach_* ops: a few multi-tensor
    kernels a group on a GPU rather than ~10 launches a parameter (the bias corrections, one per state, are host
    floats: no sync)."""
    beta1, beta2 = betas
    for state, grad in zip(states, grads):
        if not state:
            state.update(new_adamw_state(grad))
        state["step"] += 1
    exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_lerp_(exp_avg_sqs, torch._foreach_pow(grads, 2), 1 - beta2)
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    denoms = torch._foreach_div(exp_avg_sqs, [1 - beta2 ** s["step"] for s in states])
    torch._foreach_sqrt_(denoms)
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr / (1 - beta1 ** s["step"]) for s in states])


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
            params = group["params"]
            adamw_update(params, torch._foreach_mul([p.grad for p in params], grad_scale),
                         [self.state[p] for p in params], group["lr"], group["betas"], group["eps"],
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
                works.append(reduce_scatter_single(shard, flat, op=dist.ReduceOp.AVG, async_op=True))
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
            adamw_update([shard], [grad_shard * grad_scale], [self.state[p]], group["lr"], group["betas"],
                         group["eps"], group["weight_decay"])
            gathers.append((p, flat, all_gather_single(flat, shard, async_op=True)))
        for p, flat, work in gathers:
            work.wait()
            p.copy_(flat[:p.numel()].view_as(p))
        self._shards = []


# ---------------------------------------------------------------------------------------------------- Muon
# SGD with Nesterov momentum whose update for each 2-D matrix is orthogonalised by a quintic Newton-Schulz iteration.
# Parameters are grouped by shape, and each group's updates are orthogonalised together, as one (G, m, n) stack.

def zeropower_via_newtonschulz5(G, steps=5):
    """Push all singular values of G towards 1 (to roughly [0.7, 1.2]) with a quintic Newton-Schulz iteration.

    G is a matrix (m, n) or a stack of them (..., m, n); each matrix of a stack is orthogonalised on its own.
    The coefficients maximise the slope at zero, trading exact convergence for speed; the result is close enough
    to U V^T for an optimizer. Runs in bfloat16 on CUDA, where it is fast and stable, and float32 elsewhere.
    """
    if G.is_cuda and not torch.compiler.is_compiling():  # one compiled graph a shape: a few kernels, not ~25
        return compiled_newton_schulz()(G, steps)
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.bfloat16() if G.is_cuda else G.float()
    X = X.reshape(-1, *G.shape[-2:])  # one batch dimension, for baddbmm
    transposed = G.size(-2) > G.size(-1)
    if transposed:  # iterate on the wide orientation: X @ X.T is then the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        # B = b A + c A A, then X = a X + B X: baddbmm folds the scaling and the sum into the matmul, which keeps a
        # whole stack as fast as one matrix at a time on CPU (separate elementwise passes over a stack miss the cache)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    if transposed:
        X = X.mT
    return X.reshape(G.shape).to(G.dtype)


@functools.cache
def compiled_newton_schulz():
    """zeropower_via_newtonschulz5 compiled, made on first use (CUDA only: a CPU run keeps it eager, and no compile)."""
    return torch.compile(zeropower_via_newtonschulz5, dynamic=False)


class Muon(LocalGradients, torch.optim.Optimizer):
    """Single-process Muon. Call reduce_grads() (returns the squared gradient norm, for clipping), then step()."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        params = list(params)
        # one group per shape: a group is orthogonalised as one stack, and DistMuon hands its matrices out in turn
        shapes = sorted({tuple(p.shape) for p in params})
        groups = [{"params": [p for p in params if tuple(p.shape) == shape]} for shape in shapes]
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, grad_scale=1.0):
        for group in self.param_groups:
            self._update(group, group["params"], torch.stack([p.grad for p in group["params"]]), grad_scale)

    def _update(self, group, params, grads, grad_scale):
        """Update same-shaped params from their gradients stacked as (G, m, n): one batched Newton-Schulz call."""
        g = grads * grad_scale
        self._blend(group, params, list(g.unbind(0)))  # momentum per matrix (state per parameter), into the stack
        g = zeropower_via_newtonschulz5(g, group["ns_steps"])
        self._apply(group, params, list(g.unbind(0)), *g.shape[-2:])

    @staticmethod
    def new_state(p):
        """A matrix's state before its first update (sharded like the parameter under FSDP)."""
        return {"momentum_buffer": torch.zeros_like(p)}

    def _blend(self, group, params, grads):
        """Momentum, then Nesterov: each of grads (a param's scaled gradient, or this rank's rows of it) becomes the
        matrix to orthogonalise, in place (torch._foreach_*: a few kernels for the list); returns grads. Elementwise,
        so it works on shards as on whole matrices."""
        for p in params:
            if not self.state[p]:
                self.state[p].update(self.new_state(p))
        bufs = [local(self.state[p]["momentum_buffer"]) for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
        if group["nesterov"]:
            torch._foreach_lerp_(grads, bufs, group["momentum"])
        else:
            torch._foreach_copy_(grads, bufs)
        return grads

    @staticmethod
    def _apply(group, params, updates, m, n):
        """params (or their rows) move by the orthogonalised updates of their (m, n) matrices (or the same rows)."""
        # tall matrices get a larger step so every shape moves its outputs by a similar RMS amount
        step_size = group["lr"] * max(1.0, m / n) ** 0.5
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        torch._foreach_add_(params, updates, alpha=-step_size)


class DistMuon(Muon):
    """Muon under DDP: gradients are reduce-scattered so that each rank owns every world_size-th matrix of a
    shape group, orthogonalises only those (as one stack), and all-gathers the updated matrices back to everyone.

    Collectives are asynchronous: reduce_grads() starts every reduce-scatter at once and waits for them only before
    the norm (clipping needs the whole averaged gradient before any update); step() starts each group's all-gathers
    as soon as that group is updated, so they run while the next groups are orthogonalised, and waits at the end.
    """

    @torch.no_grad()
    def reduce_grads(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        self._owned, works = [], []  # (group, params this rank updates, their averaged grads stacked)
        for group in self.param_groups:
            params = group["params"]
            mine = params[rank::world]
            owned = params[0].grad.new_empty((len(mine), *params[0].shape))
            for i, base in enumerate(range(0, len(params), world)):
                grads = [p.grad for p in params[base:base + world]]
                grads += [torch.zeros_like(grads[0])] * (world - len(grads))
                out = owned[i] if i < len(mine) else torch.empty_like(grads[0])  # chunk i holds mine[i] if any
                works.append(dist.reduce_scatter(out, grads, op=dist.ReduceOp.AVG, async_op=True))
            self._owned.append((group, mine, owned))
        for work in works:
            work.wait()
        return squared_norm(owned for _, _, owned in self._owned)

    @torch.no_grad()
    def step(self, grad_scale=1.0):
        rank, world = dist.get_rank(), dist.get_world_size()
        works = []
        for group, mine, grads in self._owned:
            if mine:
                self._update(group, mine, grads, grad_scale)
            params = group["params"]
            for base in range(0, len(params), world):
                chunk = params[base:base + world]
                padded = chunk + [torch.empty_like(chunk[0]) for _ in range(world - len(chunk))]
                works.append(dist.all_gather(padded, padded[rank].clone(), async_op=True))
        for work in works:
            work.wait()
        self._owned = []


def row_share(rows, world):
    """FSDP's dim-0 shard size: torch.chunk's, ceil(rows / world) (the last ranks' shards may be shorter or empty)."""
    return -(-rows // world)


class ShardedMuon(Muon):
    """Muon on FSDP row-shards. Momentum is kept on the shards (elementwise, like the parameter). For each shape
    group, matrix i is owned by rank i % world: one all_to_all per `world` matrices brings every owner its matrix's
    rows, the owner orthogonalises all its matrices as one stack, and a second all_to_all returns each rank its rows
    of every update. Equal to Muon on the whole matrices (tests/test_fsdp.py)."""

    @torch.no_grad()
    def step(self, grad_scale=1.0):
        rank, world = dist.get_rank(), dist.get_world_size()
        for group in self.param_groups:
            params = group["params"]
            m, n = params[0].shape
            share = row_share(m, world)
            blended = self._blend(group, params, torch._foreach_mul([local(p.grad) for p in params], grad_scale))
            owned = [self._gather_to_owner(blended[base:base + world], m, share, n, world)
                     for base in range(0, len(params), world)]
            # the batches this rank owns a matrix of: a prefix (only the last batch can fall short of `world`)
            mine = sum(1 for base in range(0, len(params), world) if base + rank < len(params))
            updates = torch.zeros(len(owned), m, n, dtype=owned[0].dtype, device=owned[0].device)
            if mine:  # a slice, not a list index: a list would be copied host-to-device, a blocking copy every step
                updates[:mine] = zeropower_via_newtonschulz5(torch.stack(owned[:mine]), group["ns_steps"])
            for i, base in enumerate(range(0, len(params), world)):
                rows = self._scatter_from_owner(updates[i], share, n, world)
                shards = [local(p) for p in params[base:base + world]]
                self._apply(group, shards, [update[:p.size(0)] for p, update in zip(shards, rows)], m, n)

    @staticmethod
    def _gather_to_owner(parts, m, share, n, world):
        """parts: this rank's rows of up to `world` matrices (k-th owned by rank k); returns the whole matrix this
        rank owns (zeros if none)."""
        send = [torch.zeros(share, n, dtype=parts[0].dtype, device=parts[0].device) for _ in range(world)]
        for k, part in enumerate(parts):
            send[k][:part.size(0)] = part
        recv = [torch.empty_like(send[0]) for _ in range(world)]
        all_to_all(recv, send)
        return torch.cat(recv)[:m]

    @staticmethod
    def _scatter_from_owner(update, share, n, world):
        """update: the whole update this rank owns (zeros if none); returns this rank's rows of each owner's."""
        padded = torch.zeros(share * world, n, dtype=update.dtype, device=update.device)
        padded[:update.size(0)] = update
        recv = [torch.empty(share, n, dtype=update.dtype, device=update.device) for _ in range(world)]
        all_to_all(recv, list(padded.split(share)))
        return recv


# ---------------------------------------------------------------------------------------------------- the model's
# groups
def setup_optimizers(model, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0, scalar_lr=0.02):
    """Muon for the transformer matrices, AdamW for embedding, lm_head and the per-channel state decays
    (distributed variants under DDP)."""
    ddp = distributed()
    trunk = [p for block in model.blocks() for p in block.parameters()]
    matrix_params = [p for p in trunk if p.ndim == 2]
    scalar_params = [p for p in trunk if p.ndim < 2]  # Muon orthogonalises matrices only
    dmodel_lr_scale = (model.config.n_embd / 768) ** -0.5  # AdamW lrs were tuned at width 768
    adam_groups = [
        dict(params=list(model.lm_head.parameters()), lr=unembedding_lr * dmodel_lr_scale),
        dict(params=list(model.transformer.wte.parameters()), lr=embedding_lr * dmodel_lr_scale),
    ] + ([dict(params=scalar_params, lr=scalar_lr)] if scalar_params else [])
    if model.config.halt_head:
        adam_groups.append(dict(params=list(model.halt_head.parameters()), lr=unembedding_lr * dmodel_lr_scale))
    adam_cls, muon_cls = (DistAdamW, DistMuon) if ddp else (AdamW, Muon)
    adamw = adam_cls(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=weight_decay)
    muon = muon_cls(matrix_params, lr=matrix_lr, momentum=0.95, weight_decay=weight_decay)
    optimizers = [adamw, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


# ---------------------------------------------------------------------------------------------------- one step
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


# ---------------------------------------------------------------------------------------------------- schedules
def lr_multiplier(step, num_iterations, warmup_steps, warmdown_ratio, final_lr_frac):
    warmdown_steps = round(warmdown_ratio * num_iterations)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step <= num_iterations - warmdown_steps:
        return 1.0
    progress = (num_iterations - step) / warmdown_steps
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(step):
    """Momentum warms up from 0.85 to 0.95 over the first 300 steps, as in nanochat."""
    frac = min(step / 300, 1)
    return (1 - frac) * 0.85 + frac * 0.95


def set_schedule(optimizers, lr_multiplier, momentum):
    """This step's learning rates (every group's initial lr x the multiplier) and Muon's momentum."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier
        if isinstance(opt, Muon):  # DistMuon too
            for group in opt.param_groups:
                group["momentum"] = momentum
