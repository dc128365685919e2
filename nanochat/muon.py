"""
Muon: SGD with Nesterov momentum whose update for each 2-D matrix is orthogonalised by a quintic Newton-Schulz
iteration, and DistMuon, which shards that orthogonalisation across DDP ranks.
"""

import torch
import torch.distributed as dist


def zeropower_via_newtonschulz5(G, steps=5):
    """Push all singular values of G towards 1 (to roughly [0.7, 1.2]) with a quintic Newton-Schulz iteration.

    The coefficients maximise the slope at zero, trading exact convergence for speed; the result is close enough
    to U V^T for an optimizer. Runs in bfloat16 on CUDA, where it is fast and stable, and float32 elsewhere.
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.bfloat16() if G.is_cuda else G.float()
    transposed = G.size(-2) > G.size(-1)
    if transposed:  # iterate on the wide orientation: X @ X.T is then the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


class Muon(torch.optim.Optimizer):
    """Single-process Muon. Call reduce_grads() (returns the squared gradient norm, for clipping), then step()."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        params = list(params)
        # one group per shape, so DistMuon can hand out same-shaped matrices to ranks in turn
        shapes = sorted({tuple(p.shape) for p in params})
        groups = [{"params": [p for p in params if tuple(p.shape) == shape]} for shape in shapes]
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def reduce_grads(self):
        return sum((p.grad.float().square().sum() for g in self.param_groups for p in g["params"]),
                   torch.zeros((), device=self.param_groups[0]["params"][0].device))

    @torch.no_grad()
    def step(self, grad_scale=1.0):
        for group in self.param_groups:
            for p in group["params"]:
                self._update(p, p.grad, group, grad_scale)

    def _update(self, p, grad, group, grad_scale):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        g = grad * grad_scale
        buf.lerp_(g, 1 - group["momentum"])
        g = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        g = zeropower_via_newtonschulz5(g, group["ns_steps"])
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        # tall matrices get a larger step so every shape moves its outputs by a similar RMS amount
        p.add_(g, alpha=-group["lr"] * max(1.0, p.size(-2) / p.size(-1)) ** 0.5)


class DistMuon(Muon):
    """Muon under DDP: gradients are reduce-scattered so that each rank owns every world_size-th matrix of a
    shape group, orthogonalises only those, and all-gathers the updated matrices back to everyone."""

    @torch.no_grad()
    def reduce_grads(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        self._owned = []  # (param, averaged grad, group) for the matrices this rank updates
        for group in self.param_groups:
            params = group["params"]
            for base in range(0, len(params), world):
                chunk = params[base:base + world]
                grads = [p.grad for p in chunk] + [torch.zeros_like(chunk[0])] * (world - len(chunk))
                owned = torch.empty_like(chunk[0])
                dist.reduce_scatter(owned, grads, op=dist.ReduceOp.AVG)
                if rank < len(chunk):
                    self._owned.append((chunk[rank], owned, group))
        return sum((g.float().square().sum() for _, g, _ in self._owned),
                   torch.zeros((), device=self.param_groups[0]["params"][0].device))

    @torch.no_grad()
    def step(self, grad_scale=1.0):
        for p, grad, group in self._owned:
            self._update(p, grad, group, grad_scale)
        world = dist.get_world_size()
        for group in self.param_groups:
            params = group["params"]
            for base in range(0, len(params), world):
                chunk = params[base:base + world]
                padded = chunk + [torch.empty_like(chunk[0]) for _ in range(world - len(chunk))]
                mine = padded[dist.get_rank()].clone()
                dist.all_gather(padded, mine)
        self._owned = []
