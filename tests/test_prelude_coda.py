"""Prelude and coda (GPTConfig.n_prelude, n_coda): plain blocks that run once before and after the recursion. They
keep every guarantee of the recursion: causality, cached == uncached, exact gradients, counted FLOPs, their own
optimizer groups, and old checkpoints unchanged."""

import pytest
import torch

from nanochat.model.engine import KVCache
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.model.halting import Halting, check_halting, forward_halting
from nanochat.train.flops import estimate_flops
from nanochat.train.optim import setup_optimizers
from tests.support.helpers import random_model, tiny_config
from tests.test_engine import cached_logits
from tests.test_gpt import assert_same_grads, random_batch, twin
from tests.test_halting import HeldAttention

CONFIGS = [dict(n_loops=1, n_prelude=1, n_coda=1), dict(n_loops=2, n_prelude=2, n_coda=0, n_kv_head=2),
           dict(n_loops=0, n_prelude=0, n_coda=2), dict(n_loops=1, T_recursion=2, n_prelude=1, n_coda=2,
                                                        state_update="decay")]


def config_of(overrides, **more):
    return tiny_config(**{"n_sup_train": 3, **overrides, **more})


@pytest.mark.parametrize("overrides", CONFIGS)
@torch.no_grad()
def test_future_tokens_change_nothing_at_or_before_t_at_every_step(overrides):
    config = config_of(overrides)
    model = random_model(config, every_weight=True)
    idx, targets = random_batch(config)
    idx2 = idx.clone()
    idx2[:, 7:] = (idx[:, 7:] + 1) % config.vocab_size
    for s in range(1, 4):
        a, b = model(idx, n_sup=s), model(idx2, n_sup=s)
        torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-3)
    losses, losses2 = model(idx, targets, loss_reduction="none"), model(idx2, targets, loss_reduction="none")
    torch.testing.assert_close(losses[:, :, :7], losses2[:, :, :7], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", CONFIGS)
@torch.no_grad()
def test_cached_decoding_matches_the_full_forward(overrides):
    config = config_of(overrides)
    model = random_model(config, every_weight=True)
    idx = random_batch(config)[0]
    for n_sup in (1, 3):
        full = model(idx, n_sup=n_sup)
        for prompt_len in (1, 5):
            torch.testing.assert_close(cached_logits(model, idx, prompt_len, n_sup), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("detach", [True, False])
def test_forward_backward_gives_the_gradients_of_the_total_and_every_block_learns(detach):
    config = config_of(dict(n_loops=1, n_prelude=1, n_coda=2), detach_between_steps=detach)
    model = random_model(config)
    stepwise = twin(model, config)
    batch = random_batch(config)
    total, _ = model(*batch)
    total.backward()
    total_s, _ = stepwise.forward_backward(*batch)
    torch.testing.assert_close(total_s, total.detach())
    assert_same_grads(model, stepwise)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    state = model.diagnose(batch[0])  # the state diagnostics start from the prelude's x
    assert state.shape == (3, 4) and torch.isfinite(state).all() and state[0, 2] > 0


def test_prelude_and_coda_matrices_go_to_muon():
    model = GPT(config_of(dict(n_prelude=1, n_coda=1)))
    adamw, muon = setup_optimizers(model)
    in_muon = {id(p) for group in muon.param_groups for p in group["params"]}
    for blocks in (model.transformer.prelude, model.transformer.coda):
        assert all(id(p) in in_muon for p in blocks.parameters())
    in_any = in_muon | {id(p) for group in adamw.param_groups for p in group["params"]}
    assert in_any == {id(p) for p in model.parameters()}


def test_flops_count_the_prelude_once_and_the_coda_as_often_as_it_runs():
    """Attention calls during a training and an inference forward, counted by hooks, against estimate_flops."""
    config = config_of(dict(n_loops=1, n_prelude=1, n_coda=2))
    model = random_model(config)
    calls = []
    for block in model.blocks():
        block.attn.register_forward_hook(lambda *_: calls.append(1))
    P_block = sum(p.numel() for p in model.transformer.h[0].parameters())
    per_app = 2 * P_block + 4 * config.n_embd * config.sequence_len
    V, C, L = config.vocab_size, config.n_embd, config.n_layer
    model(*random_batch(config, B=1))
    # prelude 1, recursion 3 steps x L layers x 2 applications, coda 2 at each of the 3 steps' losses
    assert len(calls) == 1 + 3 * L * 2 + 3 * 2
    assert estimate_flops(model) == 3 * per_app * len(calls) + 3 * 6 * V * C
    calls.clear()
    with torch.no_grad():
        model(random_batch(config, B=1)[0])
    assert len(calls) == 1 + 3 * L * 2 + 2  # at inference the coda runs once, on the last step's answer
    assert estimate_flops(model, backward=False) == per_app * len(calls) + 3 * 2 * V * C


def test_a_model_without_them_has_the_same_state_dict_and_an_old_config_loads():
    saved = tiny_config().to_dict()
    del saved["n_prelude"], saved["n_coda"], saved["halt_head"]
    config = GPTConfig.from_dict(saved)
    assert (config.n_prelude, config.n_coda) == (0, 0)
    assert not any("prelude" in k or "coda" in k for k in GPT(config).state_dict())
    per_block = len(GPT(config).transformer.h[0].state_dict())
    assert len(GPT(config).state_dict()) + 4 * per_block == len(GPT(config.replace(n_prelude=2, n_coda=2)).state_dict())


@pytest.mark.parametrize("halt", ["rms:0.5", "head:0.3"])
@torch.no_grad()
def test_halting_with_prelude_and_coda_matches_the_whole_sequence_reference(halt):
    config = config_of(dict(n_loops=2, n_prelude=1, n_coda=1), n_sup_train=4, halt_head=True)
    model = random_model(config, every_weight=True)
    idx = random_batch(config)[0]
    expected, expected_steps = forward_halting(model, idx, Halting.parse(halt), HeldAttention())
    assert len(expected_steps.unique()) > 1
    cache = KVCache(model.num_attention_slots(4), idx.size(0), idx.size(1))
    outputs = [forward_halting(model, idx[:, :4], Halting.parse(halt), cache)]
    outputs += [forward_halting(model, idx[:, t:t + 1], Halting.parse(halt), cache) for t in range(4, idx.size(1))]
    assert torch.equal(torch.cat([o[1] for o in outputs], dim=1), expected_steps)
    torch.testing.assert_close(torch.cat([o[0] for o in outputs], dim=1), expected, atol=1e-4, rtol=0)


def test_kl_halting_with_a_coda_is_refused_in_one_sentence():
    model = GPT(config_of(dict(n_coda=1)))
    with pytest.raises(ValueError, match="with a coda would run the coda at every step; use rms or head"):
        check_halting(model, Halting.parse("kl:0.001"))
