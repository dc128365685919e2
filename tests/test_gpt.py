"""Tests for the TRM GPT: causality, gradient flow, baseline equivalence, the deep-supervision loss, the config."""

import functools
import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nanochat.model.gpt as gpt_module
import nanochat.model.supervision as supervision
from nanochat.model.gpt import GPT, STATE_UPDATES, GPTConfig
from nanochat.model.supervision import STATE_DIAGNOSTICS, deep_supervision_loss, supervision_weights
from nanochat.train.compile import compile_regions
from nanochat.train.flops import estimate_flops
from nanochat.train.optim import clipped_step, reduce_gradients, setup_optimizers
from tests.support.helpers import ROOT, random_model, tiny_config

GPT_SOURCE = Path(ROOT, "nanochat", "model", "gpt.py")


def random_batch(config, B=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (B, config.sequence_len), generator=g)
    targets = torch.randint(0, config.vocab_size, (B, config.sequence_len), generator=g)
    return idx, targets


# ---------------------------------------------------------------------------------------------------- causality

# every value of every axis appears: n_loops x T_recursion x activation, with n_sup, GQA and detach cycled
CAUSALITY_CONFIGS = [
    dict(n_loops=n_loops, T_recursion=T, activation_fn=act, n_sup_train=1 + i % 4, n_sup_inference=1 + i % 4,
         n_kv_head=2 if i % 2 else 4, detach_between_steps=bool(i // 2 % 2))
    for i, (n_loops, T, act) in enumerate(itertools.product([0, 1, 2], [1, 2], ["relu_squared", "swiglu", "geglu"]))
    if n_loops or T == 1  # T_recursion > 1 needs latent loops (see the validation test)
]


# every state update, with latent loops 1 and 2, sweeps 1 and 2, detached or not
CAUSALITY_CONFIGS += [dict(state_update=u, n_loops=1 + i % 2, T_recursion=1 + i // 2 % 2, n_sup_train=3,
                           n_sup_inference=3, detach_between_steps=bool(i % 3 == 0))
                      for i, u in enumerate(STATE_UPDATES)]


@pytest.mark.parametrize("overrides", CAUSALITY_CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@torch.no_grad()
def test_future_tokens_change_no_logit_or_loss_at_or_before_t(overrides):
    config = tiny_config(**overrides)
    model = random_model(config)
    idx, targets = random_batch(config)
    t = 6
    idx2, targets2 = idx.clone(), targets.clone()
    idx2[:, t + 1:] = (idx[:, t + 1:] + 1) % config.vocab_size  # every later token differs
    targets2[:, t + 1:] = (targets[:, t + 1:] + 1) % config.vocab_size
    per_step = lambda x: torch.stack([model(x, n_sup=s) for s in range(1, config.n_sup_inference + 1)])
    logits, logits2 = per_step(idx), per_step(idx2)  # step s's logits: a forward of s steps
    losses = model(idx, targets, loss_reduction="none")
    losses2 = model(idx2, targets2, loss_reduction="none")
    assert logits.shape[0] == losses.shape[0] == config.n_sup_train
    # every supervision step, every position <= t: identical
    torch.testing.assert_close(logits[:, :, :t + 1], logits2[:, :, :t + 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(losses[:, :, :t + 1], losses2[:, :, :t + 1], atol=1e-5, rtol=1e-5)
    # ...while the perturbation really reached the later positions of every step (otherwise the above proves nothing)
    for s in range(config.n_sup_train):
        assert not torch.allclose(logits[s, :, t + 1:], logits2[s, :, t + 1:], atol=1e-3)


# ---------------------------------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("T_recursion, n_loops", [
    (1, 0), (1, 1), (1, 2), (2, 1), (2, 2),
])
def test_every_parameter_of_every_layer_gets_a_gradient(T_recursion, n_loops):
    config = tiny_config(T_recursion=T_recursion, n_loops=n_loops, n_sup_train=2)
    model = random_model(config)
    total, _ = model(*random_batch(config))
    total.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"


def twin(model, config):
    """A model under another config with the same weights."""
    other = GPT(config)
    other.load_state_dict(model.state_dict())
    return other


def assert_same_grads(model, other):
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("T_recursion", [1, 2])
def test_activation_checkpointing_gives_the_same_gradients(T_recursion):
    config = tiny_config(n_loops=2, T_recursion=T_recursion, n_sup_train=2)
    model = random_model(config)
    ckpt = twin(model, config.replace(activation_checkpointing=True))
    batch = random_batch(config)
    loss, _ = model(*batch)
    loss_ckpt, _ = ckpt(*batch)
    loss.backward()
    loss_ckpt.backward()
    torch.testing.assert_close(loss_ckpt, loss)
    assert_same_grads(model, ckpt)


def test_plain_blocks_with_no_grad_sweeps_are_rejected():
    # a plain block (n_loops=0) never re-reads x, and the no-grad sweeps would consume y = x: nothing reaches wte
    with pytest.raises(ValueError, match="T_recursion=2 needs n_loops >= 1"):
        tiny_config(n_loops=0, T_recursion=2)


@pytest.mark.parametrize("detach, T_recursion, n_loops, state_update, preset", [
    (False, 1, 1, "residual", "aggressive"), (True, 1, 1, "residual", "aggressive"),
    (True, 2, 1, "residual", "moderate"),
    (False, 1, 0, "residual", "extreme"), (False, 2, 2, "trm", "extreme"), (True, 1, 1, "postnorm", "moderate"),
    (False, 1, 2, "decay", "aggressive"), (True, 2, 1, "decay", "extreme"),
])
@pytest.mark.parametrize("consistency_weight", [0.0, 0.7])
def test_forward_backward_gives_the_gradients_of_the_total(detach, T_recursion, n_loops, state_update, preset,
                                                           consistency_weight):
    # each step's head is backpropagated on its own (and with detach, each step's trunk too): the gradients must
    # equal total.backward()'s
    config = GPTConfig.with_refinement_preset(preset, **tiny_config(
        n_loops=n_loops, T_recursion=T_recursion, n_sup_train=3, detach_between_steps=detach,
        state_update=state_update, consistency_weight=consistency_weight).to_dict())
    model = random_model(config)
    stepwise = twin(model, config)
    batch = random_batch(config)
    for n_sup in (3, 5):  # the trained count, and a deeper one as sample_n_sup draws
        model.zero_grad(set_to_none=True)
        stepwise.zero_grad(set_to_none=True)
        total, aux = model(*batch, n_sup=n_sup)
        (total * 0.5).backward()
        total_s, aux_s = stepwise.forward_backward(*batch, loss_scale=0.5, n_sup=n_sup)
        torch.testing.assert_close(total_s, total.detach())
        torch.testing.assert_close(aux_s["step_losses"], aux["step_losses"])
        assert aux_s["state"].shape == (n_sup, len(STATE_DIAGNOSTICS))
        assert_same_grads(model, stepwise)


def test_the_consistency_term_is_each_later_steps_relative_move_weighed_as_its_loss():
    # worked by hand from model.refine and plain cross-entropy: no supervision code but the weights' formula
    config = tiny_config(n_loops=2, n_sup_train=3, consistency_weight=0.7)
    model = random_model(config)
    idx, targets = random_batch(config)
    ys = [y for y, _ in model.refine(idx, 4)]
    ce = [F.cross_entropy(model.head(y).flatten(0, 1), targets.flatten()) for y in ys]
    base, scale = config.supervision_weight_base, config.improvement_reward_scale
    w = [base ** s / sum(base ** j for j in range(4)) for s in range(4)]
    total = sum(w[s] * ce[s] for s in range(4))
    for s in range(1, 4):
        reward = scale / ce[s - 1].detach()
        moved = ((ys[s] - ys[s - 1].detach()).square().sum(-1) / ys[s - 1].detach().square().sum(-1)).mean()
        total = total - reward * (ce[s - 1].detach() - ce[s]) + (w[s] + reward) * 0.7 * moved
    got, aux = model(idx, targets, n_sup=4)
    torch.testing.assert_close(got, total)
    torch.testing.assert_close(aux["step_losses"], torch.stack(ce).detach())  # reported losses stay cross-entropy
    without, _ = twin(model, config.replace(consistency_weight=0.0))(idx, targets, n_sup=4)
    assert without < got - 1e-3  # the term is there to be found


def test_detach_between_steps_keeps_forward_and_still_trains_every_parameter():
    config = tiny_config(n_loops=1, T_recursion=1, n_sup_train=3)
    model = random_model(config)
    detached = twin(model, config.replace(detach_between_steps=True, backprop_steps=1))
    batch = random_batch(config)
    total, aux = model(*batch)
    total_d, aux_d = detached(*batch)
    torch.testing.assert_close(aux_d["step_losses"], aux["step_losses"])
    torch.testing.assert_close(total_d, total)
    total.backward()
    total_d.backward()
    for name, p in detached.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"
    # the flag must actually cut something: gradients through earlier steps' states are gone
    assert any(not torch.allclose(p.grad, q.grad) for p, q in zip(model.parameters(), detached.parameters()))


# ---------------------------------------------------------------------------------------------------- baseline

def reference_gpt(model, idx, targets):
    """nanochat's plain pre-norm GPT (late 2025), written out from the raw weights, sharing no code with gpt.py."""
    c = model.config
    W = {k: v.detach() for k, v in model.state_dict().items()}
    B, T = idx.shape
    hd = c.n_embd // c.n_head

    def rms_norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)

    inv_freq = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.arange(T).float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos, sin = angles.cos()[None, None], angles.sin()[None, None]

    def rotary(x):  # x: (B, heads, T, hd); rotate the pairs (x_i, x_{i + hd/2})
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)

    def heads(x, n):
        return x.view(B, T, n, hd).transpose(1, 2)

    mask = torch.ones(T, T, dtype=torch.bool).tril()
    x = rms_norm(W["transformer.wte.weight"][idx])
    for l in range(c.n_layer):
        p = f"transformer.h.{l}."
        h = rms_norm(x)
        q = rms_norm(rotary(heads(h @ W[p + "attn.c_q.weight"].T, c.n_head)))
        k = rms_norm(rotary(heads(h @ W[p + "attn.c_k.weight"].T, c.n_kv_head)))
        v = heads(h @ W[p + "attn.c_v.weight"].T, c.n_kv_head)
        group = c.n_head // c.n_kv_head  # query head i reads key/value head i // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, c.n_embd)
        x = x + y @ W[p + "attn.c_proj.weight"].T
        h = torch.relu(rms_norm(x) @ W[p + "mlp.c_fc.weight"].T) ** 2
        x = x + h @ W[p + "mlp.c_proj.weight"].T
    logits = rms_norm(x) @ W["lm_head.weight"].T
    logits = 15 * torch.tanh(logits / 15)
    loss = F.cross_entropy(logits.view(-1, c.vocab_size), targets.view(-1), ignore_index=-1)
    return logits, loss


@pytest.mark.parametrize("state_update", list(STATE_UPDATES))
def test_baseline_config_is_a_plain_pre_norm_gpt(state_update):
    # n_loops=0 is nanochat's GPT whatever state_update says: the update variants act on the recursion's y and z
    config = tiny_config(n_loops=0, T_recursion=1, n_sup_train=1, n_head=4, n_kv_head=2, state_update=state_update)
    model = random_model(config)
    idx, targets = random_batch(config)
    targets[0, :3] = -1  # ignored positions
    ref_logits, ref_loss = reference_gpt(model, idx, targets)
    with torch.no_grad():
        logits = model(idx)
        total, aux = model(idx, targets)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(total, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux["step_losses"], ref_loss[None], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- the loss

def test_supervision_weights_for_base_5_and_4_steps():
    # 5**s / (1 + 5 + 25 + 125)
    assert supervision_weights(4, 5.0) == pytest.approx([1 / 156, 5 / 156, 25 / 156, 125 / 156])
    assert supervision_weights(4, 5.0) == pytest.approx([0.0064, 0.0321, 0.1603, 0.8013], abs=1e-4)


@pytest.mark.parametrize("base", [3.0, 5.0, 10.0])
@pytest.mark.parametrize("n_sup", [1, 2, 4])
def test_supervision_weights_are_normalised_powers(base, n_sup):
    denominator = sum(base ** j for j in range(n_sup))
    assert supervision_weights(n_sup, base) == pytest.approx([base ** s / denominator for s in range(n_sup)])


@pytest.mark.parametrize("preset", ["moderate", "aggressive", "extreme"])
def test_total_is_weighted_losses_minus_improvement_reward(preset):
    config = GPTConfig.with_refinement_preset(preset, **{k: getattr(tiny_config(), k) for k in
                                                        ("sequence_len", "vocab_size", "n_layer", "n_head",
                                                         "n_kv_head", "n_embd")}, n_sup_train=4)
    model = random_model(config)
    with torch.no_grad():
        total, aux = model(*random_batch(config))
    L = aux["step_losses"].tolist()
    b, c = config.supervision_weight_base, config.improvement_reward_scale
    w = [b ** s / sum(b ** j for j in range(4)) for s in range(4)]
    expected = sum(ws * ls for ws, ls in zip(w, L)) - c * sum((L[s - 1] - L[s]) / L[s - 1] for s in range(1, 4))
    assert total.item() == pytest.approx(expected, rel=1e-5)
    assert aux["refinement"].item() == pytest.approx((L[0] - L[-1]) / L[0], rel=1e-5)


def test_improvement_reward_stops_gradient_into_previous_step():
    b, c = 5.0, 1.0
    losses = torch.tensor([4.0, 3.0, 2.5, 2.4], requires_grad=True)
    deep_supervision_loss(list(losses.unbind()), b, c).backward()
    w = [b ** s / sum(b ** j for j in range(4)) for s in range(4)]
    L = losses.tolist()
    # d total / d loss_k = w_k + c / loss_{k-1}; no -c * loss_{k+1} / loss_k**2 term from the next step's reward
    expected = [w[0]] + [w[k] + c / L[k - 1] for k in range(1, 4)]
    torch.testing.assert_close(losses.grad, torch.tensor(expected))


def test_a_solved_step_keeps_the_reward_finite():
    # a solved step's float32 loss is exactly 0 (softcapped logits at +-15); the reward's weight on the next step is
    # then scale / 0.01 (REWARD_LOSS_FLOOR), not inf: before the floor, hops runs that solved the task went NaN
    from nanochat.model.supervision import REWARD_LOSS_FLOOR, ChunkedHeadLoss, head_chunk_loss_and_grads
    weight = torch.full((8, 4), -50.0)
    weight[3] = 50.0
    solved = ChunkedHeadLoss.apply(torch.ones(2, 4), weight, torch.full((2,), 3), head_chunk_loss_and_grads)
    assert solved.item() == 0.0  # the premise: the loss reaches exactly zero
    losses = torch.stack([torch.tensor(1.0), solved, torch.tensor(0.5)]).requires_grad_()
    total = deep_supervision_loss(list(losses.unbind()), 5.0, 1.0)
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(losses.grad).all()
    w = supervision_weights(3, 5.0)
    torch.testing.assert_close(losses.grad, torch.tensor([w[0], w[1] + 1.0, w[2] + 1.0 / REWARD_LOSS_FLOOR]))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_backprop_steps_truncates_the_gradient_every_k_steps(k):
    # k=1 is the detached TRM gradient, k=n_sup_train full backpropagation; k=2 is neither, and equals a model whose
    # states are detached by hand after steps 2 and 4 only
    def grads(**overrides):
        model = random_model(tiny_config(n_sup_train=4, **overrides), every_weight=True)
        model.forward_backward(*random_batch(model.config))
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    truncated = grads(detach_between_steps=True, backprop_steps=k)
    one_step = lambda: grads(detach_between_steps=True, backprop_steps=1)  # noqa: E731 - the TRM's detach
    reference = {1: one_step, 4: lambda: grads(detach_between_steps=False)}
    if k in reference:
        torch.testing.assert_close(truncated, reference[k](), atol=1e-6, rtol=1e-5)
    else:
        assert not torch.allclose(truncated, one_step(), atol=1e-6)
        assert not torch.allclose(truncated, grads(detach_between_steps=False), atol=1e-6)
        model = random_model(tiny_config(n_sup_train=4, detach_between_steps=False), every_weight=True)
        cuts = [False, True, False, True]
        model.cuts_after = lambda step: cuts[step]
        model.forward_backward(*random_batch(model.config))
        by_hand = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        torch.testing.assert_close(truncated, by_hand, atol=1e-6, rtol=1e-5)


def test_model_gradient_is_the_stop_gradient_linearisation():
    # through the model: grad(total) == grad(sum_k coef_k * loss_k) with coef_k = w_k + c / sg(loss_{k-1})
    config = tiny_config(n_sup_train=3, improvement_reward_scale=2.0)
    model = random_model(config)
    batch = random_batch(config)
    total, aux = model(*batch)
    g_total = torch.autograd.grad(total, list(model.parameters()))
    L = aux["step_losses"].tolist()
    b, c = config.supervision_weight_base, config.improvement_reward_scale
    w = [b ** s / sum(b ** j for j in range(3)) for s in range(3)]
    coef = [w[0]] + [w[k] + c / L[k - 1] for k in range(1, 3)]
    per_step = model(*batch, loss_reduction="none").mean(dim=(1, 2))
    g_lin = torch.autograd.grad(sum(ck * lk for ck, lk in zip(coef, per_step)), list(model.parameters()))
    for a, e in zip(g_total, g_lin):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------- the config

@pytest.mark.parametrize("name, base, scale", [("uniform", 1.0, 0.0), ("moderate", 3.0, 0.5), ("aggressive", 5.0, 1.0),
                                               ("extreme", 10.0, 2.0)])
def test_refinement_presets(name, base, scale):
    config = GPTConfig.with_refinement_preset(name)
    assert (config.supervision_weight_base, config.improvement_reward_scale) == (base, scale)
    # explicit overrides win over the preset
    assert GPTConfig.with_refinement_preset(name, improvement_reward_scale=0.0).improvement_reward_scale == 0.0


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError) as e:
        GPTConfig.with_refinement_preset("turbo")
    assert all(name in str(e.value) for name in ("moderate", "aggressive", "extreme"))


@pytest.mark.parametrize("overrides, field", [
    (dict(n_embd=30, n_head=4), "n_embd"),  # head dimension not an integer
    (dict(n_embd=12, n_head=4, n_kv_head=4), "n_embd"),  # odd head dimension: rotary needs pairs
    (dict(n_head=4, n_kv_head=3), "n_kv_head"),
    (dict(sequence_len=0), "sequence_len"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(n_layer=0), "n_layer"),
    (dict(n_head=0), "n_head"),
    (dict(n_kv_head=0), "n_kv_head"),
    (dict(n_embd=0), "n_embd"),
    (dict(n_loops=-1), "n_loops"),
    (dict(T_recursion=0), "T_recursion"),
    (dict(n_sup_train=0), "n_sup_train"),
    (dict(n_sup_inference=0), "n_sup_inference"),
    (dict(n_loops=1.5), "n_loops"),
    (dict(supervision_weight_base=0.0), "supervision_weight_base"),
    (dict(supervision_weight_base=-2.0), "supervision_weight_base"),
    (dict(improvement_reward_scale=-0.1), "improvement_reward_scale"),
    (dict(activation_fn="gelu"), "activation_fn"),
])
def test_invalid_config_raises_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_zero_reward_scale_and_zero_loops_are_valid():
    config = tiny_config(improvement_reward_scale=0.0, n_loops=0)
    assert config.improvement_reward_scale == 0.0 and config.n_loops == 0


def test_default_weight_lines_are_plain_literals():
    # the guides tell users to edit exactly these lines between training phases
    lines = [line.strip() for line in GPT_SOURCE.read_text().splitlines()]
    assert "supervision_weight_base: float = 5.0" in lines
    assert "improvement_reward_scale: float = 1.0" in lines
    assert (GPTConfig().supervision_weight_base, GPTConfig().improvement_reward_scale) == (5.0, 1.0)


def test_editing_the_default_lines_changes_plain_gptconfig(tmp_path, monkeypatch):
    source = GPT_SOURCE.read_text()
    edited = source.replace("supervision_weight_base: float = 5.0", "supervision_weight_base: float = 10.0")
    edited = edited.replace("improvement_reward_scale: float = 1.0", "improvement_reward_scale: float = 2.0")
    assert edited.count("= 10.0") > source.count("= 10.0") and edited.count("= 2.0") > source.count("= 2.0")
    path = tmp_path / "gpt_edited.py"
    path.write_text(edited)
    # inside the nanochat package, as gpt.py runs: its relative imports (.halting, .supervision) resolve there
    spec = importlib.util.spec_from_file_location("nanochat.model.gpt_edited", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "nanochat.model.gpt_edited", module)
    spec.loader.exec_module(module)
    assert (module.GPTConfig().supervision_weight_base, module.GPTConfig().improvement_reward_scale) == (10.0, 2.0)
    # and a model built from the edited defaults trains on them: total uses b=10, c=2
    config = module.GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=4, n_kv_head=4, n_embd=32,
                              n_loops=1, n_sup_train=2)
    torch.manual_seed(0)
    model = module.GPT(config)
    model.init_weights()
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
        total, aux = model(*random_batch(config))
    L0, L1 = aux["step_losses"].tolist()
    assert total.item() == pytest.approx(L0 / 11 + 10 * L1 / 11 - 2.0 * (L0 - L1) / L0, rel=1e-5)


def test_n_sup_inference_defaults_to_n_sup_train_and_can_be_lower():
    assert tiny_config(n_sup_train=3).n_sup_inference == 3
    assert tiny_config(n_sup_train=3, n_sup_inference=1).n_sup_inference == 1
    config = tiny_config(n_sup_train=3, n_sup_inference=1)
    model = random_model(config)
    idx, _ = random_batch(config)
    with torch.no_grad():
        logits = model(idx)
        torch.testing.assert_close(logits, model(idx, n_sup=1))
        assert not torch.allclose(logits, model(idx, n_sup=3), atol=1e-3)  # the steps really differ
        assert model(idx, idx, loss_reduction="none").shape[0] == 3  # training still uses n_sup_train


def test_n_sup_argument_sets_the_number_of_supervised_steps():
    config = tiny_config(n_sup_train=2)
    model = random_model(config)
    with torch.no_grad():
        _, aux = model(*random_batch(config), n_sup=4)
    assert aux["step_losses"].shape == (4,)


# ---------------------------------------------------------------------------------------------------- flops

def expected_flops(model, n_sup, backward=True):
    """TRM per-token FLOPs from the spec: n_sup * [L*(n_loops+1) * (2 P_block + 4 h q t) * (3 + T-1) + 6 V d]."""
    c = model.config
    P_block = sum(p.numel() for p in model.transformer.h[0].parameters())
    attn = 4 * c.n_head * (c.n_embd // c.n_head) * c.sequence_len
    grad_mult = 3 if backward else 1
    per_app = 2 * P_block + attn
    return n_sup * (c.n_layer * (c.n_loops + 1) * per_app * (grad_mult + c.T_recursion - 1)
                    + grad_mult * 2 * c.vocab_size * c.n_embd)


def test_plain_model_flops_are_nanochats_formula():
    config = tiny_config(n_loops=0, T_recursion=1, n_sup_train=1)
    model = GPT(config)
    non_embedding = sum(p.numel() for p in model.parameters()) - model.transformer.wte.weight.numel()
    L, h, q, t = config.n_layer, config.n_head, config.n_embd // config.n_head, config.sequence_len
    assert estimate_flops(model) == 6 * non_embedding + 12 * L * h * q * t


@pytest.mark.parametrize("n_loops, T_recursion", [(0, 1), (1, 1), (2, 1), (1, 2), (2, 3)])
def test_flops_scale_with_the_recursion(n_loops, T_recursion):
    config = tiny_config(n_loops=n_loops, T_recursion=T_recursion, n_sup_train=2, n_sup_inference=3)
    model = GPT(config)
    assert estimate_flops(model) == expected_flops(model, 2)
    assert estimate_flops(model, n_sup=4) == 2 * estimate_flops(model, n_sup=2)
    assert estimate_flops(model, backward=False) == expected_flops(model, 3, backward=False)


def test_flops_count_the_block_applications_the_forward_makes():
    # count attention calls (one per block application), with and without gradient, during one training forward
    config = tiny_config(n_loops=2, T_recursion=2, n_sup_train=3)
    model = random_model(config)
    calls = {True: 0, False: 0}
    for block in model.transformer.h:
        block.attn.register_forward_hook(lambda *_: calls.__setitem__(torch.is_grad_enabled(),
                                                                      calls[torch.is_grad_enabled()] + 1))
    model(*random_batch(config, B=1))
    P_block = sum(p.numel() for p in model.transformer.h[0].parameters())
    per_app = 2 * P_block + 4 * config.n_embd * config.sequence_len
    head = 3 * 6 * config.vocab_size * config.n_embd
    # n_sup=3 steps x n_layer x (n_loops + 1 = 3) applications, once with gradient and once (T_recursion - 1) without
    assert calls[True] == 3 * config.n_layer * 3 and calls[False] == 3 * config.n_layer * 3
    assert estimate_flops(model) == per_app * (3 * calls[True] + calls[False]) + head


# ---------------------------------------------------------------------------------------------------- training

def test_tiny_trm_overfits_one_batch_and_later_steps_are_better():
    config = tiny_config(n_layer=1, n_embd=32, n_head=4, n_kv_head=4, n_loops=1, T_recursion=1, n_sup_train=3)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()  # the real init, zero projections included: training must get out of it
    optimizers = setup_optimizers(model)
    batch = random_batch(config, B=8)
    first = None
    for step in range(20):
        total, aux = model(*batch)
        total.backward()
        clipped_step(optimizers, reduce_gradients(optimizers).sqrt().item(), grad_clip=1.0)  # base_train's update
        model.zero_grad(set_to_none=True)
        first = aux["step_losses"] if first is None else first
    with torch.no_grad():
        _, aux = model(*batch)
    losses = aux["step_losses"].tolist()
    assert first.tolist() == pytest.approx([math.log(config.vocab_size)] * 3, rel=1e-4)  # uniform at init
    assert losses[-1] < 0.1 * first[-1].item()
    assert losses == sorted(losses, reverse=True), losses


# ---------------------------------------------------------------------------------------------------- state updates

def rms_of_y_by_step(state_update, n_sup=32):
    config = tiny_config(n_loops=1, n_sup_train=2, state_update=state_update)
    model = random_model(config)
    diagnostics = model.diagnose(random_batch(config)[0], n_sup=n_sup)
    return diagnostics[:, STATE_DIAGNOSTICS.index("rms_y")]


@pytest.mark.parametrize("state_update", [u for u in STATE_UPDATES if u != "residual"])
def test_bounded_state_updates_keep_the_state_rms_bounded_over_32_steps(state_update):
    rms = rms_of_y_by_step(state_update)
    assert torch.isfinite(rms).all()
    assert rms[16:].max() < 1.2 * rms[4:16].max(), rms  # no growth with the step count
    assert rms.max() < 20


def test_the_residual_state_grows_with_the_step_count():
    # the defect the bounded updates fix, and proof that the test above can fail
    rms = rms_of_y_by_step("residual")
    assert rms[31] > 1.5 * rms[15] > 2 * rms[3]


def test_state_diagnostics_measure_the_update():
    from nanochat.model.supervision import state_diagnostics
    previous = torch.ones(2, 3, 4)
    y = 3 * torch.ones(2, 3, 4)  # update 2 * previous: parallel
    z = torch.full((2, 3, 4), -2.0)
    rms_y, rms_z, rms_update, cos = state_diagnostics(previous, y, z).tolist()
    assert (rms_y, rms_z, rms_update) == pytest.approx((3.0, 2.0, 2.0))
    assert cos == pytest.approx(1.0)
    assert state_diagnostics(previous, previous - torch.ones(2, 3, 4) * 0, None)[1] == 0


def test_decay_parameters_are_per_channel_start_near_one_and_go_to_adamw():
    config = tiny_config(n_loops=1, state_update="decay")
    model = GPT(config)
    model.init_weights()
    block = model.transformer.h[0]
    assert block.retain_y.shape == block.retain_z.shape == (config.n_embd,)
    assert 0.8 < torch.sigmoid(block.retain_y).min() < 1
    adamw, muon = setup_optimizers(model)
    adam_params = {id(p) for g in adamw.param_groups for p in g["params"]}
    muon_params = {id(p) for g in muon.param_groups for p in g["params"]}
    assert id(block.retain_y) in adam_params and id(block.retain_y) not in muon_params
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    assert not hasattr(GPT(tiny_config(n_loops=1, state_update="trm")).transformer.h[0], "retain_y")


def test_a_config_saved_before_state_update_existed_loads_as_the_residual_recursion():
    saved = tiny_config(n_loops=1).to_dict()
    del saved["state_update"], saved["sample_n_sup"]
    config = GPTConfig.from_dict(saved)
    assert config.state_update == "residual" and config.sample_n_sup is False
    assert GPTConfig.from_dict({**saved, "state_update": "trm"}).state_update == "trm"


def test_an_old_checkpoint_gives_the_same_logits_as_before(tmp_path, monkeypatch):
    from nanochat.checkpoint import manager as ckpt
    from nanochat.checkpoint.manager import build_model
    from nanochat.checkpoint.writer import save_checkpoint
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    config = tiny_config(n_loops=1, n_sup_train=2, state_update="residual")  # what every old checkpoint is
    model = random_model(config).eval()
    meta = {"model_config": {k: v for k, v in config.to_dict().items() if k not in ("state_update", "sample_n_sup")}}
    save_checkpoint("old", 1, model, [], meta, rank_state={})
    loaded = build_model(ckpt.read_meta("old", 1)["model_config"], "cpu")
    loaded.load_state_dict(ckpt.load_model_weights("old", 1, "cpu"))
    idx = random_batch(config)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(idx), model(idx), atol=0, rtol=0)
    assert loaded.config.state_update == "residual"


def test_an_unknown_step_count_sampler_is_refused():
    with pytest.raises(ValueError, match="sample_n_sup"):
        tiny_config(sample_n_sup="poisson")


@pytest.mark.parametrize("state_update", list(STATE_UPDATES))
def test_flops_are_the_same_for_every_state_update_and_for_sampled_depth(state_update):
    base = GPT(tiny_config(n_loops=2, T_recursion=2, n_sup_train=3))
    for overrides in (dict(state_update=state_update), dict(state_update=state_update, sample_n_sup=True)):
        model = GPT(tiny_config(n_loops=2, T_recursion=2, n_sup_train=3, **overrides))
        assert estimate_flops(model) == estimate_flops(base) == expected_flops(base, 3)


# ---------------------------------------------------------------------------------------------------- compile

def compiled_training_matches_eager(config, backend, steps=2, scope="layer"):
    """Train a compiled twin (compile scope `scope`) and an eager model side by side: equal losses and gradients, and
    no graph compiled after the first step, even with evaluation and cached sampling in between. Returns the graphs
    compiled."""
    from torch._dynamo.utils import counters

    from nanochat.model.engine import Engine
    torch._dynamo.reset()
    counters.clear()
    eager = random_model(config)
    compiled = twin(eager, config)
    compile_regions(compiled, scope, backend=backend)
    batch = random_batch(config)
    for step in range(steps):
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
        total, aux = eager.forward_backward(*batch)
        total_c, aux_c = compiled.forward_backward(*batch)
        torch.testing.assert_close(total_c, total, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(aux_c["step_losses"], aux["step_losses"], atol=1e-5, rtol=1e-5)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
        with torch.no_grad():  # evaluation: compiled too (its own graph, once), and the eager model's numbers
            torch.testing.assert_close(compiled(*batch, loss_reduction="none"), eager(*batch, loss_reduction="none"),
                                       atol=1e-5, rtol=1e-5)
        Engine(compiled.eval()).generate_batch([[1, 2, 3]], max_tokens=3, temperature=0)  # sampling: eager
        compiled.train()
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a graph was compiled after the first step and evaluation"
    return graphs


def test_regional_compile_graphs_do_not_grow_with_the_recursion_and_never_recompile():
    # dynamo's capture and guards with the aot_eager backend (seconds); inductor's numerics in the slow test below
    # per grad mode: the first layer visit (z does not require grad yet), every other visit; the head's loss chunk;
    # the no-gradient sweeps of T_recursion 2 add the no-grad twin's graphs for inputs that require grad (T_recursion
    # 1's graphs are a subset of these, so 2 alone is compiled: each compile costs seconds). The deeper model, one more
    # of every axis, also carries its state detached between steps (the TRM paper's default): compile still takes
    # effect there, in the same graphs. Its graph count is dynamo's alone, so it is traced with the "eager" backend
    # (a quarter of the time); aot_eager's numerics of those same graphs are the shallow model's.
    shallow = compiled_training_matches_eager(tiny_config(n_loops=1, T_recursion=2, n_sup_train=2, n_layer=2),
                                              "aot_eager", steps=2)
    deep = compiled_training_matches_eager(tiny_config(n_loops=2, T_recursion=3, n_sup_train=3, n_layer=3,
                                                       detach_between_steps=True), "eager", steps=1)
    assert 1 <= shallow == deep <= 8, (shallow, deep)


def test_the_whole_model_compiled_matches_eager_in_a_fixed_number_of_graphs():
    # compile scope "model": the embedding and each sweep one region; a plain GPT's trunk is then one graph (forward
    # and backward), however deep (one more layer shows it, counted by dynamo alone: the "eager" backend); the TRM's
    # sweep too (every visit unrolled in it: not its default, checked once, at one layer)
    shallow = compiled_training_matches_eager(tiny_config(n_loops=0, n_layer=2), "aot_eager", scope="model")
    deep = compiled_training_matches_eager(tiny_config(n_loops=0, n_layer=3), "eager", steps=1, scope="model")
    assert shallow == deep <= 6, (shallow, deep)
    assert compiled_training_matches_eager(tiny_config(n_loops=1, n_layer=1), "aot_eager", steps=1,
                                           scope="model") <= 8


def test_compile_scope_auto_is_the_model_for_a_plain_gpt_and_the_layer_visit_for_the_recursion():
    from nanochat.train.compile import compile_scope_for
    assert compile_scope_for(tiny_config(n_loops=0))[0] == "model"
    assert compile_scope_for(tiny_config(n_loops=1))[0] == "layer"
    assert compile_scope_for(tiny_config(n_loops=0), fsdp=True)[0] == "layer"
    assert compile_scope_for(tiny_config(n_loops=0, activation_checkpointing=True))[0] == "layer"
    assert compile_scope_for(tiny_config(n_loops=1), "model")[0] == "model"  # asked: taken
    with pytest.raises(ValueError, match="FSDP gathers"):
        compile_scope_for(tiny_config(n_loops=0), "model", fsdp=True)
    with pytest.raises(ValueError, match="unknown"):
        compile_scope_for(tiny_config(), "everything")


@pytest.mark.slow
def test_inductor_compiled_training_matches_eager_and_does_not_recompile():
    # CPU inductor compiles C++ for each graph: about a minute on 2 cores, hence slow
    graphs = compiled_training_matches_eager(tiny_config(n_loops=1, n_sup_train=2), backend="inductor")
    assert graphs <= 5  # two layer visits with gradient, the head's loss chunk, two without (evaluation)
    # the whole plain model (compile scope "model"): the embedding, the sweep with and without gradient, the head
    graphs = compiled_training_matches_eager(tiny_config(n_loops=0, n_sup_train=1), backend="inductor", scope="model")
    assert graphs <= 5  # the embedding again without gradient (evaluation shares its compiled function)


# ---------------------------------------------------------------------------------------------------- the head's loss

def plain_step_loss(model):
    """A step's training loss as it was before the chunked head: the whole batch's logits, then F.cross_entropy."""
    def step_loss(y, targets, reduction="mean"):
        logits = model.head(y)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
    return step_loss


def head_batch(config):
    idx, targets = random_batch(config, B=3)
    targets[0, :5] = -1  # ignored positions: with 5-row chunks, the first chunk counts none
    return idx, targets


@pytest.mark.parametrize("autocast, atol, rtol", [(False, 1e-6, 1e-5), (True, 2e-3, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("detach", [False, True])
def test_chunked_head_gives_the_loss_and_gradients_of_the_plain_head(detach, autocast, atol, rtol, monkeypatch):
    config = tiny_config(n_loops=2, T_recursion=2, n_sup_train=3, state_update="trm", detach_between_steps=detach)
    monkeypatch.setattr(supervision, "HEAD_CHUNK_ELEMENTS", 5 * config.vocab_size)  # 48 rows: 9 chunks of 5, one of 3
    chunked = random_model(config)
    plain = twin(chunked, config)
    plain.step_loss = plain_step_loss(plain)
    batch = head_batch(config)
    for train in ("forward_backward", "total.backward"):
        for model in (chunked, plain):
            model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if train == "forward_backward":
                results = [model.forward_backward(*batch, loss_scale=0.5) for model in (chunked, plain)]
            else:
                results = [model(*batch) for model in (chunked, plain)]
        if train == "total.backward":
            for total, _ in results:
                (total * 0.5).backward()
        (total, aux), (total_ref, aux_ref) = results
        torch.testing.assert_close(aux["step_losses"], aux_ref["step_losses"], atol=atol, rtol=rtol)
        torch.testing.assert_close(total.detach(), total_ref.detach(), atol=atol, rtol=rtol)
        for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=atol, rtol=rtol, msg=f"{train}: {name}")


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16 weights", "bf16 weights, autocast"])
def test_a_bf16_lm_head_gradient_is_summed_over_many_chunks_in_float32(autocast, monkeypatch):
    # FSDP's gathered lm_head is bf16: summing 1,024 one-row chunks' partials in bf16 lost 5% of the gradient
    torch.manual_seed(0)
    N, C, V = 1024, 64, 96
    h, targets = torch.randn(N, C), torch.randint(0, V, (N,))
    weight = (torch.randn(V, C) / 8).bfloat16()
    w64 = weight.double().requires_grad_()
    softcap = supervision.SOFTCAP
    reference = F.cross_entropy(softcap * torch.tanh(F.linear(h.double(), w64) / softcap), targets)
    reference = torch.autograd.grad(reference, w64)[0]
    monkeypatch.setattr(supervision, "HEAD_CHUNK_ELEMENTS", V)  # one row a chunk
    w = weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = supervision.ChunkedHeadLoss.apply(h if autocast else h.bfloat16(), w, targets,
                                                 supervision.head_chunk_loss_and_grads)
    grad = torch.autograd.grad(loss, w)[0]
    assert grad.dtype == torch.bfloat16
    # each partial and the final cast round to bf16 (2^-9 relative, 0.4% measured); a bf16 running sum gave 4.8%
    assert (grad.double() - reference).abs().max() / reference.abs().max() < 0.01


def test_one_planned_chunk_is_one_call_over_every_row_with_the_chunked_heads_gradients(monkeypatch):
    # model.head_chunks = 1 (the plan, where memory allows): the head is one call over the micro-batch's rows, with
    # the loss and gradients of the default 5-row chunks
    config = tiny_config(n_loops=1, n_sup_train=2)
    monkeypatch.setattr(supervision, "HEAD_CHUNK_ELEMENTS", 5 * config.vocab_size)
    chunked = random_model(config)
    whole = twin(chunked, config)
    whole.head_chunks = 1
    rows, real = [], gpt_module.normed_head_chunk_loss_and_grads
    monkeypatch.setattr(gpt_module, "normed_head_chunk_loss_and_grads",
                        lambda y, *a, **k: rows.append(y.size(0)) or real(y, *a, **k))
    batch = head_batch(config)
    (total, aux), (total_w, aux_w) = [model.forward_backward(*batch) for model in (chunked, whole)]
    n = batch[0].numel()
    assert rows[:2 * -(-n // 5)] == ([5] * (n // 5) + [n % 5]) * 2 and rows[2 * -(-n // 5):] == [n, n]
    torch.testing.assert_close(total_w, total, atol=1e-6, rtol=1e-5)
    for (name, p), q in zip(chunked.named_parameters(), whole.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_the_fusable_head_the_compiled_region_runs_equals_the_in_place_one(autocast):
    # the norm folded in, no in-place ops (what inductor fuses); aot_eager traces it as torch.compile does
    torch.manual_seed(0)
    y, weight = torch.randn(24, 32) * 3, torch.randn(100, 32)
    targets = torch.randint(0, 100, (24,))
    targets[:3] = -1
    fusable = torch.compile(functools.partial(supervision.normed_head_chunk_loss_and_grads, fusable=True),
                            backend="aot_eager", dynamic=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        w = weight.bfloat16() if autocast else weight
        got = fusable(y, w, targets, torch.tensor(1 / 21))
        want = supervision.normed_head_chunk_loss_and_grads(y, w, targets, torch.tensor(1 / 21))
    atol, rtol = (2e-3, 2e-2) if autocast else (1e-6, 1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)
    # and the normed head's y-gradient is the plain head's through norm(y)
    y_ref = y.clone().requires_grad_()
    softcap = supervision.SOFTCAP
    plain = F.cross_entropy(softcap * torch.tanh(F.linear(gpt_module.norm(y_ref), weight) / softcap), targets,
                            ignore_index=-1, reduction="sum") / 21
    grad_y = supervision.normed_head_chunk_loss_and_grads(y, weight, targets, torch.tensor(1 / 21))[1]
    torch.testing.assert_close(grad_y, torch.autograd.grad(plain, y_ref)[0], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_inductor_compiled_head_chunk_matches_the_plain_head(autocast):
    # CPU inductor builds C++ (minutes on a cold cache on 2 loaded cores), hence slow, like the test above
    torch.manual_seed(0)
    h = torch.randn(24, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True)
    targets = torch.randint(0, 100, (24,))
    targets[:3] = -1
    compiled = torch.compile(functools.partial(supervision.normed_head_chunk_loss_and_grads, fusable=True),
                             dynamic=False, backend="inductor")  # what compile_regions compiles
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = F.linear(gpt_module.norm(h), weight).float()
        softcap = supervision.SOFTCAP
        plain = F.cross_entropy(softcap * torch.tanh(logits / softcap), targets, ignore_index=-1)
        loss = supervision.ChunkedHeadLoss.apply(h, weight, targets, compiled)
    atol, rtol = (2e-3, 2e-2) if autocast else (1e-6, 1e-5)
    torch.testing.assert_close(loss, plain, atol=atol, rtol=rtol)
    for grad, grad_ref in zip(torch.autograd.grad(loss, (h, weight)), torch.autograd.grad(plain, (h, weight))):
        torch.testing.assert_close(grad, grad_ref, atol=atol, rtol=rtol)


def test_training_never_makes_the_whole_batch_logits(monkeypatch):
    config = tiny_config(vocab_size=512, n_sup_train=2)
    monkeypatch.setattr(supervision, "HEAD_CHUNK_ELEMENTS", 8 * config.vocab_size)
    model = random_model(config)
    idx, targets = random_batch(config, B=4)
    chunk_logits, head_chunk = [], gpt_module.normed_head_chunk_loss_and_grads
    def counting_chunk(h, weight, targets, grad_scale):
        chunk_logits.append(h.size(0) * weight.size(0))
        return head_chunk(h, weight, targets, grad_scale)
    monkeypatch.setattr(gpt_module, "normed_head_chunk_loss_and_grads", counting_chunk)
    model.forward_backward(idx, targets)
    # 2 steps of 4 x 16 rows, 8 rows a chunk; with no chunk larger than 8 rows' logits
    assert len(chunk_logits) == 2 * 4 * 16 // 8 and max(chunk_logits) == 8 * config.vocab_size


@torch.no_grad()
def test_stream_is_a_residual_stream_renormalised_between_steps():
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=8, vocab_size=32, n_layer=2, n_head=2, n_kv_head=2, n_embd=16,
                       state_update="stream")
    model = GPT(config)
    model.init_weights()
    for p in model.parameters():  # non-zero output projections: every block writes something
        p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, 32, (2, 8))
    (y1, z1), (y2, z2) = model.refine(idx, 2)
    residual = GPT(config.replace(state_update="residual"))
    residual.load_state_dict(model.state_dict())
    (r1, _), (r2, _) = residual.refine(idx, 2)
    assert torch.equal(y1, r1)  # within a step: the residual sum
    rms = lambda t: t.pow(2).mean(-1).sqrt()
    assert not torch.allclose(rms(y1), torch.ones(2, 8), atol=0.05)  # ... which grows past RMS 1
    y, z = model._sweep(model.embed(idx), gpt_module.norm(y1), gpt_module.norm(z1), model.rotary(8), None, 0)
    assert torch.allclose(y2, y) and torch.allclose(z2, z) and not torch.allclose(y2, r2)  # step 2 starts at RMS 1


def bf16_state_pair(state_update="trm", n_loops=2):
    """The same weights and batch with a float32 and a bfloat16 recursion state (GPTConfig.state_dtype)."""
    config = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, n_loops=n_loops,
                       n_sup_train=3, state_update=state_update)
    model = random_model(config)
    idx = torch.randint(0, config.vocab_size, (2, config.sequence_len))
    return model, idx


@pytest.mark.parametrize("state_update", list(STATE_UPDATES) + ["plain"])
def test_a_bf16_state_stays_bf16_and_its_loss_stays_float32_and_near(state_update):
    model, idx = bf16_state_pair(*(("trm", 0) if state_update == "plain" else (state_update,)))
    losses = {}
    for state_dtype in ("float32", "bfloat16"):
        model.config.state_dtype = state_dtype
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            states = list(model.refine(idx, 3))
            logits = model.head(states[-1][0])
            losses[state_dtype] = model.step_loss(states[-1][0], idx)
        want = getattr(torch, state_dtype)
        assert all(y.dtype == want and (z is None or z.dtype == want) for y, z in states), state_dtype
        assert logits.dtype == torch.float32 and losses[state_dtype].dtype == torch.float32
        assert torch.isfinite(losses[state_dtype])
    # measured: |difference| <= 0.0015 nats on a loss of ~5.95 for every update (random weights): 0.01 leaves 6x
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.01, losses


def test_a_bf16_state_trains_under_autocast_and_is_refused_without():
    model, idx = bf16_state_pair()
    model.config.state_dtype = "bfloat16"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model.forward_backward(idx, idx)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in model.parameters() if p.requires_grad and p.grad is not None)
    assert model.transformer.wte.weight.grad is not None
    with pytest.raises(ValueError, match="state_dtype='bfloat16' needs autocast"):
        model(idx, idx)


def test_state_dtype_is_checked_and_an_old_checkpoint_loads_as_float32():
    with pytest.raises(ValueError, match="state_dtype='float16' is unknown"):
        GPTConfig(state_dtype="float16")
    saved = {k: v for k, v in tiny_config().__dict__.items() if k != "state_dtype"}
    assert GPTConfig.from_dict(saved).state_dtype == "float32"
