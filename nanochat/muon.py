"""
Muon: SGD with Nesterov momentum whose update for each 2-D matrix is orthogonalised by a quintic Newton-Schulz
iteration, and DistMuon, which shards that orthogonalisation across DDP ranks.

Parameters are grouped by shape, and each group's updates are orthogonalised together, as one (G, m, n) stack.
"""

import torch
import torch.distributed as dist

from nanochat.optim import LocalGradients, local, squared_norm


def zeropower_via_newtonschulz5(G, steps=5):
    """Push all singular values of G towards 1 (to roughly [0.7, 1.2]) with a quintic Newton-Schulz iteration.

    G is a matrix (m, n) or a stack of them (..., m, n); each matrix of a stack is orthogonalised on its own.
    The coefficients maximise the slope at zero, trading exact convergence for speed; the result is close enough
    to U V^T for an optimizer. Runs in bfloat16 on CUDA, where it is fast and stable, and float32 elsewhere.
    """
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
        for p, g_p in zip(params, g):  # momentum per matrix (its state stays per parameter), written into the stack
            self._blend(group, p, g_p)
        g = zeropower_via_newtonschulz5(g, group["ns_steps"])
        for p, g_p in zip(params, g):
            self._apply(group, p, g_p, *g.shape[-2:])

    @staticmethod
    def new_state(p):
        """A matrix's state before its first update (sharded like the parameter under FSDP)."""
        return {"momentum_buffer": torch.zeros_like(p)}

    def _blend(self, group, p, g):
        """Momentum, then Nesterov: g (p's scaled gradient, or this rank's rows of it) becomes the matrix to
        orthogonalise, in place; returns g. Elementwise, so it works on shards as on whole matrices."""
        state = self.state[p]
        if not state:
            state.update(self.new_state(p))
        buf = local(state["momentum_buffer"])
        buf.lerp_(g, 1 - group["momentum"])
        if group["nesterov"]:
            g.lerp_(buf, group["momentum"])
        else:
            g.copy_(buf)
        return g

    @staticmethod
    def _apply(group, p, update, m, n):
        """p (or its rows) moves by the orthogonalised update of its (m, n) matrix (or the same rows of it)."""
        # tall matrices get a larger step so every shape moves its outputs by a similar RMS amount
        step_size = group["lr"] * max(1.0, m / n) ** 0.5
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-step_size)


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
