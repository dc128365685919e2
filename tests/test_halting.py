"""Per-token adaptive halting: its rules and thresholds, the KV cache's reuse of a halted token's keys and values,
and the learned halting head."""

import functools
import os

import pytest
import torch
import torch.nn.functional as F

from nanochat.model.engine import Engine, KVCache
from nanochat.model.gpt import GPT, HALT_BIAS_INIT, GPTConfig
from nanochat.model.halting import HALTING_RULES, Halting, forward_halting
from nanochat.train.flops import estimate_flops
from nanochat.train.optim import setup_optimizers
from tests.support import helpers

N = 4
tiny_config = functools.partial(helpers.tiny_config, sequence_len=8, n_loops=2, n_sup_train=N, halt_head=True)


def random_model(**overrides):
    # every weight random (the halting head's too), so halting decisions vary across positions
    return helpers.random_model(tiny_config(**overrides), every_weight=True)


def tokens(B, T, seed=1):
    return torch.randint(0, tiny_config().vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def halting_forward(model, idx, halt, n_sup=N):
    cache = KVCache(model.num_attention_slots(n_sup), idx.size(0), idx.size(1))
    return forward_halting(model, idx, Halting.parse(halt), cache, n_sup=n_sup)


def plain_cached(model, idx, n_sup):
    return model(idx, kv_cache=KVCache(model.num_attention_slots(n_sup), idx.size(0), idx.size(1)), n_sup=n_sup)


class HeldAttention:
    """The test's own whole-sequence attention with halting: every slot's keys and values for all positions in one
    tensor; a held position's rows come from the same slot one step earlier. No buffers, offsets or masks: what the
    engine's KVCache does incrementally, done the obvious way."""

    def __init__(self):
        self.k, self.v, self.pos, self.halted = {}, {}, 0, None

    def hold(self, halted, slots_per_step):
        self.halted, self.per_step = halted, slots_per_step

    def repeat_step(self, start, stop, slots_per_step, T):
        for slot in range(start, stop):
            self.k[slot], self.v[slot] = self.k[slot - slots_per_step], self.v[slot - slots_per_step]

    def attend(self, slot, q, k, v):
        if self.halted is not None:
            held = self.halted[:, None, :, None]
            k = torch.where(held, self.k[slot - self.per_step], k)
            v = torch.where(held, self.v[slot - self.per_step], v)
        self.k[slot], self.v[slot] = k, v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))

    def advance(self, T):
        self.pos += T
        self.halted = None


def reference(model, idx, halt):
    return forward_halting(model, idx, Halting.parse(halt), HeldAttention(), n_sup=N)


def cached_with_halting(model, idx, prompt_len, halt):
    """Prefill idx[:, :prompt_len] with halting, then feed the rest one token at a time: logits and steps."""
    cache = KVCache(model.num_attention_slots(N), idx.size(0), idx.size(1))
    outputs = [forward_halting(model, idx[:, :prompt_len], Halting.parse(halt), cache, n_sup=N)]
    for t in range(prompt_len, idx.size(1)):
        outputs.append(forward_halting(model, idx[:, t:t + 1], Halting.parse(halt), cache, n_sup=N))
    return torch.cat([o[0] for o in outputs], dim=1), torch.cat([o[1] for o in outputs], dim=1)


# thresholds at which this random model's positions halt at mixed steps (checked in the tests)
MIXED = ["kl:0.05", "rms:0.5", "head:0.3"]


@pytest.mark.parametrize("rule", list(HALTING_RULES))
@torch.no_grad()
def test_threshold_zero_runs_every_step_and_infinity_only_the_first(rule):
    model, idx = random_model(), tokens(2, 8)
    logits, steps = halting_forward(model, idx, f"{rule}:0")
    assert torch.equal(logits, plain_cached(model, idx, N)) and (steps == N).all()
    torch.testing.assert_close(logits, model(idx, n_sup=N), atol=1e-5, rtol=0)
    logits, steps = halting_forward(model, idx, f"{rule}:inf")
    assert torch.equal(logits, plain_cached(model, idx, 1)) and (steps == 1).all()


@pytest.mark.parametrize("halt", ["kl:0.2", "rms:0.8", "head:0.5"])
@torch.no_grad()
def test_a_position_halted_after_step_one_keeps_step_ones_logits(halt):
    model, idx = random_model(), tokens(2, 8)
    logits, steps = halting_forward(model, idx, halt)
    at_one = steps == 1
    assert at_one.any() and (~at_one).any()
    first = model(idx, n_sup=1)
    torch.testing.assert_close(logits[at_one], first[at_one], atol=1e-5, rtol=0)
    assert not torch.allclose(logits[~at_one], first[~at_one], atol=1e-3)  # the others refined on


@pytest.mark.parametrize("halt", MIXED)
@pytest.mark.parametrize("prompt_len", [1, 5])
@torch.no_grad()
def test_cached_decoding_with_halting_equals_the_whole_sequence_reference(halt, prompt_len):
    model, idx = random_model(), tokens(2, 10)
    expected_logits, expected_steps = reference(model, idx, halt)
    assert 1 < len(expected_steps.unique())  # positions halt at different steps
    logits, steps = cached_with_halting(model, idx, prompt_len, halt)
    assert torch.equal(steps, expected_steps)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)


@torch.no_grad()
def test_the_reference_catches_a_cache_that_recomputes_halted_keys():
    """Sanity of the comparison: a cache that forgets to hold halted keys (later tokens read recomputed ones)."""
    class Forgetful(KVCache):
        def hold(self, halted, slots_per_step):
            super().hold(None, slots_per_step)

    model, idx = random_model(), tokens(2, 10)
    expected, _ = reference(model, idx, "rms:0.5")
    cache = Forgetful(model.num_attention_slots(N), 2, 10)
    logits, _ = forward_halting(model, idx, Halting.parse("rms:0.5"), cache, n_sup=N)
    assert not torch.allclose(logits, expected, atol=1e-3)


@pytest.mark.parametrize("halt", ["kl:0.05", "rms:0.5"])
@torch.no_grad()
def test_without_a_cache_halting_keeps_answers_but_every_step_keys(halt):
    """kv_cache=None, the reference that measures the hold: every position runs all N steps (plain attention over
    every step), and each keeps the answer of the first step whose score fell below the threshold."""
    model, idx = random_model(), tokens(2, 10)
    rule, threshold = halt.split(":")
    states = [model.embed(idx)] + [y for y, _ in model.refine(idx, N)]
    logits_per_step = [model.head(y) for y in states]
    if rule == "kl":
        scores = [(F.softmax(b, -1) * (F.log_softmax(b, -1) - F.log_softmax(a, -1))).sum(-1)
                  for a, b in zip(logits_per_step, logits_per_step[1:])]
    else:
        scores = [(b - a).norm(dim=-1) / a.norm(dim=-1) for a, b in zip(states, states[1:])]
    below = torch.stack(scores) < float(threshold)  # (N, B, T)
    below[-1] = True  # a position that never halts answers at step N
    expected_steps = below.float().argmax(dim=0) + 1  # the first step whose score fell below
    expected = torch.stack(logits_per_step[1:])[expected_steps - 1, torch.arange(2)[:, None], torch.arange(10)]
    logits, steps = forward_halting(model, idx, Halting.parse(halt), None, n_sup=N)
    assert torch.equal(steps, expected_steps) and 1 < len(steps.unique())
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    held, _ = reference(model, idx, halt)  # the hold changes what later tokens read: the two differ
    assert not torch.allclose(held, logits, atol=1e-3)


@torch.no_grad()
def test_engine_greedy_generation_with_halting_equals_the_reference():
    model, prompt = random_model(), [3, 17, 5]
    engine = Engine(model)
    out = engine.generate_batch([prompt, prompt[:1]], max_tokens=6, temperature=0.0, halt="kl:0.05", stop_tokens=[])
    expected_steps = []
    for row, start in zip(out, (prompt, prompt[:1])):
        ids, used = list(start), []
        for _ in range(6):
            logits, steps = reference(model, torch.tensor([ids]), "kl:0.05")
            ids.append(int(logits[0, -1].argmax()))
            used.append(int(steps[0, -1]))
        assert row == ids[len(start):]
        expected_steps.append(used)
    assert engine.stats["steps"] == expected_steps
    assert len({s for row in expected_steps for s in row}) > 1  # tokens halted at different steps


def test_engine_rejects_malformed_rules_and_head_without_a_head():
    engine = Engine(random_model(halt_head=False))
    for bad in ["kl", "kl:", "kl:-1", "foo:0.1", "kl:x", "kl:nan"]:
        with pytest.raises(ValueError, match="RULE:THRESHOLD"):
            engine.generate([[1, 2]], halt=bad)
    with pytest.raises(ValueError, match="no halting head"):
        engine.generate([[1, 2]], halt="head:0.5")


def test_parse_reads_rule_and_threshold():
    assert Halting.parse("kl:0.0005") == Halting("kl", 0.0005)
    assert Halting.parse("rms:inf") == Halting("rms", float("inf"))
    assert str(Halting.parse("head:0.25")) == "head:0.25"


# ---------------------------------------------------------------------------------------------------- the head
def test_the_halting_head_starts_never_halting():
    model = GPT(tiny_config())
    model.init_weights()
    assert torch.equal(model.halt_head.weight, torch.zeros_like(model.halt_head.weight))
    assert model.halt_head.bias.item() == HALT_BIAS_INIT
    y = torch.randn(2, 8, model.config.n_embd)
    torch.testing.assert_close(model.halt_probability(y), torch.full((2, 8), 1 / (1 + 2.718281828 ** 5)))


def test_training_moves_the_halting_head_and_leaves_the_model_untouched():
    """The head learns on a detached y: its weights move, and every other gradient equals a head-less model's."""
    with_head = helpers.random_model(tiny_config(), every_weight=False)
    without = GPT(tiny_config(halt_head=False))
    without.load_state_dict({k: v for k, v in with_head.state_dict().items() if not k.startswith("halt_head")})
    idx, targets = tokens(2, 8), tokens(2, 8, seed=2)
    _, aux = with_head.forward_backward(idx, targets)
    without.forward_backward(idx, targets)
    assert aux["halt_loss"] > 0 and with_head.halt_head.weight.grad.abs().sum() > 0
    for (name, p), q in zip(without.named_parameters(), [p for n, p in with_head.named_parameters()
                                                           if not n.startswith("halt_head")]):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    before = with_head.halt_head.bias.item()
    for opt in setup_optimizers(with_head):
        opt.step()
    assert with_head.halt_head.bias.item() != before


def test_a_checkpoint_without_a_halting_head_loads_unchanged():
    old = helpers.random_model(tiny_config(halt_head=False))
    saved = old.config.to_dict()
    del saved["halt_head"]  # a checkpoint written before the field existed
    config = GPTConfig.from_dict(saved)
    assert config.halt_head is False
    model = GPT(config)
    model.load_state_dict(old.state_dict())  # strict: no parameter missing or left over
    idx = tokens(1, 8)
    assert torch.equal(model(idx), old(idx))


def test_flops_count_the_halting_head():
    head, plain = GPT(tiny_config()), GPT(tiny_config(halt_head=False))
    C, V = head.config.n_embd, head.config.vocab_size
    # training: per step, the per-token losses' extra lm_head forward (2*V*C) and the head's forward and weight grads
    assert estimate_flops(head) - estimate_flops(plain) == N * (2 * V * C + 4 * C)
    assert estimate_flops(head, backward=False) - estimate_flops(plain, backward=False) == N * 2 * C


# ---------------------------------------------------------------------------------------------------- evaluation
def test_evaluation_with_halting_spans_step_one_to_every_step():
    """Threshold 0 scores what evaluate_bpb scores at the last step, infinity its first step; mean steps N and 1;
    in between, the mean steps of the tokens that count, from the test's own reference forward."""
    from nanochat.eval.loss_eval import evaluate_bpb, evaluate_bpb_halting
    model = random_model()
    V = model.config.vocab_size
    token_bytes = torch.arange(V) % 3  # a third of the ids are 'specials' (0 bytes) and left out
    batches = [(tokens(2, 8, seed=s), tokens(2, 8, seed=s + 10)) for s in range(2)]
    per_step, _ = evaluate_bpb(model, iter(batches), 2, token_bytes, n_sup=N)
    bpb, mean = evaluate_bpb_halting(model, iter(batches), 2, token_bytes, Halting.parse("kl:0"))
    assert mean == N and bpb == pytest.approx(per_step[-1], abs=1e-6)
    bpb, mean = evaluate_bpb_halting(model, iter(batches), 2, token_bytes, Halting.parse("kl:inf"))
    assert mean == 1 and bpb == pytest.approx(per_step[0], abs=1e-6)
    _, mean = evaluate_bpb_halting(model, iter(batches), 2, token_bytes, Halting.parse("kl:0.05"))
    counted = [(token_bytes[y] > 0, reference(model, x, "kl:0.05")[1]) for x, y in batches]
    expected = sum(steps[c].sum().item() for c, steps in counted) / sum(c.sum().item() for c, _ in counted)
    assert 1 < mean < N and mean == pytest.approx(expected)
    bpb, mean = evaluate_bpb_halting(model, iter(batches), 2, token_bytes, Halting.parse("kl:0"), hold_keys=False)
    assert mean == N and bpb == pytest.approx(per_step[-1], abs=1e-6)
    held, _ = evaluate_bpb_halting(model, iter(batches), 2, token_bytes, Halting.parse("kl:0.05"))
    unheld, _ = evaluate_bpb_halting(model, iter(batches), 2, token_bytes, Halting.parse("kl:0.05"), hold_keys=False)
    assert held != pytest.approx(unheld, abs=1e-6)


def test_base_loss_halt_prints_the_halting_line_and_saves_it(trained_tiny, monkeypatch, capsys):
    from scripts import base_loss
    monkeypatch.setenv("NANOCHAT_BASE_DIR", trained_tiny)
    results = base_loss.main(["--model_tag=halt", "--device_type=cpu", "--device_batch_size=2", "--split_tokens=128",
                              "--sample_tokens=2", "--halt=rms:inf"])
    assert "val halting rms:inf: bpb " in capsys.readouterr().out
    assert results["val_halting"]["mean_steps"] == 1 and results["val_halting"]["n_sup"] == 3
    assert results["val_halting"]["bpb"] == pytest.approx(results["val_bpb"][0], abs=1e-6)


@pytest.mark.parametrize("flag, message", [("--halt=kl", "halting rule 'kl': write RULE:THRESHOLD"),
                                           ("--halt=head:0.5", "has no halting head")])
def test_base_loss_bad_halt_is_one_line(trained_tiny, monkeypatch, capsys, flag, message):
    from scripts import base_loss
    monkeypatch.setenv("NANOCHAT_BASE_DIR", trained_tiny)
    before = helpers.tree(trained_tiny)
    with pytest.raises(SystemExit) as exit_info:
        base_loss.main(["--model_tag=halt", "--device_type=cpu", "--device_batch_size=2", "--split_tokens=128", flag])
    code = exit_info.value.code
    lines = [code] if isinstance(code, str) else [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert code not in (0, None) and len(lines) == 1 and message in lines[0], lines
    assert helpers.tree(trained_tiny) == before


def test_base_train_with_halt_head_trains_the_head(trained_tiny, monkeypatch):
    """A tiny base_train run with --halt_head: the checkpoint has a head, and training moved it off its init."""
    from nanochat.checkpoint.manager import load_model
    from scripts import base_train
    monkeypatch.setenv("NANOCHAT_BASE_DIR", trained_tiny)
    base_train.main(helpers.TINY + ["--n_sup_train=3", "--num_iterations=2", "--eval_every=0", "--halt_head",
                                    "--model_tag=head"])
    model, _, _ = load_model("head", "latest", "cpu")
    assert model.config.halt_head and model.halt_head.bias.item() != HALT_BIAS_INIT
    assert model.halt_head.weight.abs().sum() > 0


def test_halting_curve_writes_the_table_and_the_plot(trained_tiny, monkeypatch, tmp_path):
    from dev import halting_curve
    monkeypatch.setenv("NANOCHAT_BASE_DIR", trained_tiny)
    monkeypatch.setitem(halting_curve.THRESHOLDS, "kl", [0.0, float("inf")])
    out = str(tmp_path / "curve")
    rows = halting_curve.main(["--model_tag=halt", "--device_type=cpu", "--device_batch_size=2",
                               "--split_tokens=128", "--rules=kl,head", f"--out={out}"])
    fixed = [r for r in rows if r[0] == "fixed"]
    assert [r[2] for r in fixed] == [1.0, 2.0, 3.0] and [r[0] for r in rows[3:]] == ["kl", "kl"]  # no head: skipped
    # threshold 0 is the fixed last step, infinity the fixed first, with or without held keys
    assert rows[3][2:] == pytest.approx((3.0, fixed[-1][3], fixed[-1][3]))
    assert rows[4][2:] == pytest.approx((1.0, fixed[0][3], fixed[0][3]))
    with open(out + ".md") as f:
        assert f.read().count("\n| ") == 1 + 5  # the header, then a row per point
    assert os.path.getsize(out + ".png") > 1000
