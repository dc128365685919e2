"""Tests for Muon, AdamW, their distributed forms, and the clipped update (reduce_gradients, clipped_step)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanochat.train.optim import AdamW, Muon, clipped_step, reduce_gradients, zeropower_via_newtonschulz5
from tests.support import dist_optim_worker as worker
from tests.support import forked, processes

REPO = Path(__file__).resolve().parents[1]


def newton_schulz_reference(G, steps=5):
    """One matrix at a time, with separate matmuls and sums: the iteration as written before batching."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.T if G.size(0) > G.size(1) else G
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.T if G.size(0) > G.size(1) else X


# ---------------------------------------------------------------------------------------------------- Newton-Schulz

@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (48, 96), (96, 48), (3, 64, 24)])
def test_newton_schulz_puts_singular_values_of_random_rectangular_matrices_near_1(shape):
    torch.manual_seed(0)
    G = torch.randn(shape) * 37.0  # the scale must not matter
    X = zeropower_via_newtonschulz5(G)
    assert X.shape == G.shape
    s = torch.linalg.svdvals(X)
    assert s.min() > 0.5 and s.max() < 1.5, (s.min(), s.max())


@pytest.mark.parametrize("n", [32, 128])
def test_newton_schulz_puts_singular_values_of_square_matrices_near_1(n):
    # a square Gaussian matrix has singular values arbitrarily close to 0, which 5 iterations cannot lift (Muon's
    # known trade-off); give it a spread of 100x instead, about what a gradient's top directions span
    torch.manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(n, n))
    V, _ = torch.linalg.qr(torch.randn(n, n))
    G = U @ torch.diag(torch.logspace(-2, 0, n) * 5) @ V.T
    s = torch.linalg.svdvals(zeropower_via_newtonschulz5(G))
    assert s.min() > 0.5 and s.max() < 1.5, (s.min(), s.max())


@pytest.mark.parametrize("shape", [(5, 64, 16), (5, 16, 64), (4, 32, 32), (2, 3, 24, 40)])
def test_batched_newton_schulz_equals_one_matrix_at_a_time(shape):
    # scales 1e-3 .. 1e3 within one stack: each matrix must be normalised on its own, not by the stack's norm
    torch.manual_seed(0)
    G = torch.randn(shape) * torch.logspace(-3, 3, shape[-3]).view(-1, 1, 1)
    batched = zeropower_via_newtonschulz5(G).reshape(-1, *shape[-2:])
    matrices = G.reshape(-1, *shape[-2:])
    for i, g in enumerate(matrices):
        torch.testing.assert_close(batched[i], zeropower_via_newtonschulz5(g), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(batched[i], newton_schulz_reference(g), atol=1e-6, rtol=1e-5)


def test_newton_schulz_keeps_the_singular_vectors():
    # orthogonalisation changes the singular values only: X ~ U V^T, so <X, U V^T> / ||U V^T||^2 is close to 1
    torch.manual_seed(0)
    G = torch.randn(40, 24)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    X = zeropower_via_newtonschulz5(G)
    polar = U @ Vh
    cos = (X * polar).sum() / (X.norm() * polar.norm())
    assert cos > 0.97


# ---------------------------------------------------------------------------------------------------- Muon

def least_squares(W, A, B):
    return ((A @ W.T - B) ** 2).mean()


def test_muon_update_points_downhill():
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(8, 16))
    A, B = torch.randn(64, 16), torch.randn(64, 8)
    least_squares(W, A, B).backward()
    before = W.detach().clone()
    Muon([W], lr=0.02).step()
    assert ((W.detach() - before) * W.grad).sum() < 0


def test_muon_decreases_a_least_squares_loss():
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.zeros(8, 16))
    A = torch.randn(64, 16)
    B = A @ (0.1 * torch.randn(8, 16)).T  # realisable: the optimum has zero loss
    opt = Muon([W], lr=0.05)
    start = least_squares(W, A, B).item()
    for _ in range(30):
        opt.zero_grad()
        least_squares(W, A, B).backward()
        opt.step()
    assert least_squares(W, A, B).item() < 0.1 * start


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_equals_a_per_matrix_reference(nesterov):
    # the batched step against Muon written out one matrix at a time: momentum, Nesterov or not, weight decay, the
    # clip's grad_scale and the aspect-ratio step size, over three steps of two shape groups
    torch.manual_seed(0)
    shapes = [(8, 16), (16, 8), (8, 16), (8, 16), (16, 8)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    expected = [p.detach().clone() for p in params]
    bufs = [torch.zeros(s) for s in shapes]
    lr, momentum, wd, scale = 0.02, 0.9, 0.1, 0.5
    opt = Muon(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    for _ in range(3):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape)
            g = p.grad * scale
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g
            update = newton_schulz_reference(momentum * bufs[i] + (1 - momentum) * g if nesterov else bufs[i])
            expected[i] = expected[i] * (1 - lr * wd) - lr * max(1.0, p.size(0) / p.size(1)) ** 0.5 * update
        opt.step(grad_scale=scale)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, atol=1e-6, rtol=1e-5)


def test_muon_groups_params_by_shape():
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(4, 8), (8, 4), (4, 8), (2, 2)]]
    groups = Muon(params).param_groups
    assert sorted(len(g["params"]) for g in groups) == [1, 1, 2]
    assert all(len({tuple(p.shape) for p in g["params"]}) == 1 for g in groups)


# ---------------------------------------------------------------------------------------------------- AdamW

def test_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(5, 3))
    p2 = torch.nn.Parameter(p1.detach().clone())
    ours = AdamW([dict(params=[p1])], lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([p2], lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(5):
        g = torch.randn(5, 3)
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p1, p2)


# ---------------------------------------------------------------------------------------------------- clipping

class RecordingOptimizer:
    def __init__(self, *grads):
        self.grads, self.scales = grads, []

    def reduce_grads(self):
        return sum(g.square().sum() for g in self.grads)

    def step(self, grad_scale=1.0):
        self.scales.append(grad_scale)


@pytest.mark.parametrize("clip, expected_scale", [(1.0, 1.0 / 13), (20.0, 1.0), (0.0, 1.0)])
def test_reduce_gradients_gives_the_global_norm_and_clipped_step_scales_to_the_clip(clip, expected_scale):
    # two optimizers' gradients (3, 4) and (12,): global norm sqrt(9 + 16 + 144) = 13
    a, b = RecordingOptimizer(torch.tensor([3.0, 4.0])), RecordingOptimizer(torch.tensor([12.0]))
    grad_norm = reduce_gradients([a, b]).sqrt().item()
    clipped_step([a, b], grad_norm, clip)
    assert grad_norm == pytest.approx(13.0)
    assert a.scales == b.scales == [pytest.approx(expected_scale, rel=1e-5)]


# ---------------------------------------------------------------------------------------------------- the step

def stepped_model(n_layer):
    """A tiny model's optimizers after one step (state made), every parameter given a fresh random gradient."""
    from nanochat.train.optim import setup_optimizers
    from tests.support.helpers import random_model, tiny_config
    model = random_model(tiny_config(n_layer=n_layer, n_loops=1, state_update="decay"), every_weight=True)
    optimizers = setup_optimizers(model, weight_decay=0.1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        norm = reduce_gradients(optimizers).sqrt().item()
        clipped_step(optimizers, norm, 1.0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return optimizers, reduce_gradients(optimizers).sqrt().item()


def test_the_optimizer_step_reads_nothing_from_the_device():
    # the update is queued whole: no tensor value reaches Python (a host sync on a GPU) once the norm is known
    from tests.support.helpers import host_syncs
    optimizers, norm = stepped_model(2)
    with host_syncs() as syncs:
        clipped_step(optimizers, norm, 1.0)
    assert syncs == []


def test_the_optimizer_step_launches_as_many_ops_for_a_deeper_model():
    # AdamW and Muon's elementwise work runs as torch._foreach_* ops over lists: the ops the host issues a step (one
    # launch or a few on a GPU each) do not grow with the number of matrices, as they did parameter by parameter
    from torch.profiler import ProfilerActivity, profile

    def ops(n_layer):
        optimizers, norm = stepped_model(n_layer)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            clipped_step(optimizers, norm, 1.0)
        aten = [e for e in prof.events() if e.name.startswith("aten::")]  # each issued by Python, not inside an op
        return sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))

    shallow, deep = ops(2), ops(6)
    assert shallow == deep, (shallow, deep)


# ---------------------------------------------------------------------------------------------------- distributed

def test_dist_optimizers_on_two_gloo_ranks_match_single_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # the ranks as torchrun starts them, forked from the torch-preloaded server: the claim is two ranks
    proc = forked.Ranks([sys.executable, str(REPO / "tests" / "support" / "dist_optim_worker.py"), str(tmp_path)],
                        nproc=worker.WORLD_SIZE, env=env, cwd=REPO, stderr=subprocess.STDOUT)
    output = processes.finish(proc, timeout=180).stdout
    assert proc.returncode == 0, output[-6000:]
    reference = worker.run(distributed=False)
    start = worker.build_gpt().state_dict()
    for rank in range(worker.WORLD_SIZE):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # same clipped norms as the single process, and the clip really clipped
        norms = [n for pair in got["norms"] for n in pair]
        assert norms == pytest.approx([n for pair in reference["norms"] for n in pair], rel=1e-5)
        assert all(n > worker.GRAD_CLIP for n in norms)
        for name, value in reference["gpt"].items():
            torch.testing.assert_close(got["gpt"][name], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")
            assert not torch.equal(value, start[name]), f"{name} never moved"
        for i, value in enumerate(reference["toy"]):
            torch.testing.assert_close(got["toy"][i], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} toy {i}")


def test_dist_adamw_uses_the_old_collective_names_on_a_torch_without_the_new(monkeypatch, tmp_path):
    """torch before 2.13 (the GPU machine's 2.11, cloud images) has reduce_scatter_tensor and all_gather_into_tensor
    only: DistAdamW must call those there, and update as the single-process AdamW does."""
    import torch.distributed as dist

    from nanochat.train.optim import DistAdamW
    calls = []
    for new, old in (("reduce_scatter_single", "reduce_scatter_tensor"),
                     ("all_gather_single", "all_gather_into_tensor")):
        real = getattr(dist, new, None) or getattr(dist, old)  # 2.13's old names warn and forward to the new
        monkeypatch.delattr(dist, new, raising=False)
        monkeypatch.setattr(dist, old, lambda *a, _real=real, _name=old, **k: calls.append(_name) or _real(*a, **k))
    g = torch.Generator().manual_seed(0)
    start, grad = torch.randn(7, 3, generator=g), torch.randn(7, 3, generator=g)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    for p in params:
        p.grad = grad.clone()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        distributed = DistAdamW([dict(params=[params[0]])], lr=0.1, betas=(0.8, 0.95))
        distributed.reduce_grads()
        distributed.step()
    finally:
        dist.destroy_process_group()
    single = AdamW([dict(params=[params[1]])], lr=0.1, betas=(0.8, 0.95))
    single.reduce_grads()
    single.step()
    assert calls == ["reduce_scatter_tensor", "all_gather_into_tensor"]
    torch.testing.assert_close(params[0].data, params[1].data)
    assert not torch.equal(params[0].data, start)


def test_all_to_all_falls_back_to_a_gather_where_gloo_has_none(monkeypatch, tmp_path):
    """Gloo before torch 2.13 refuses all_to_all (ShardedMuon's exchange): every rank gathers every send instead."""
    import torch.distributed as dist

    from nanochat import collectives

    def refuse(recv, send):
        raise RuntimeError("Backend gloo does not support alltoall")
    monkeypatch.setattr(dist, "all_to_all", refuse)
    monkeypatch.setitem(collectives._ALL_TO_ALL, "native", True)
    send = [torch.randn(3, 4)]
    recv = [torch.full((3, 4), float("nan"))]
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        collectives.all_to_all(recv, send)
        assert collectives._ALL_TO_ALL["native"] is False  # asked once: later calls go straight to the gather
        send2, recv2 = [torch.randn(3, 4)], [torch.empty(3, 4)]
        collectives.all_to_all(recv2, send2)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(recv[0], send[0])
    torch.testing.assert_close(recv2[0], send2[0])
