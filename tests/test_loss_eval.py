"""nanochat/loss_eval.evaluate_bpb, which every validation number rests on, against bits per byte computed by hand."""

import math
import re
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import tqdm.std

from nanochat.collectives import RankFailure
from nanochat.eval.loss_eval import evaluate_bpb
from nanochat.model.gpt import GPT
from nanochat.model.supervision import STATE_DIAGNOSTICS
from tests.support.helpers import tiny_config

V = 8
# Bytes of each token id. Ids 0 and 5 are special tokens (0 bytes); the last id has bytes, so a target of -1 read
# as token_bytes[-1] would be counted.
TOKEN_BYTES = torch.tensor([0, 1, 2, 3, 4, 0, 2, 5])
# (x, y) batches of 2 rows x 3 positions; -1 is an ignored target. Only the first two are evaluated (steps=2).
BATCHES = [
    (torch.tensor([[1, 2, 3], [4, 6, 7]]), torch.tensor([[1, 2, 0], [3, -1, 5]])),
    (torch.tensor([[2, 4, 4], [1, 6, 3]]), torch.tensor([[4, 4, 7], [6, 0, -1]])),
    (torch.tensor([[3, 3, 3], [3, 3, 3]]), torch.tensor([[1, 1, 1], [1, 1, 1]])),
]
# By hand: the counted targets are those with bytes, ignored ones and specials (0, 5) left out:
#   batch 1: tokens 1, 2, 3 -> 3 tokens, 1 + 2 + 3 = 6 bytes
#   batch 2: tokens 4, 4, 7, 6 -> 4 tokens, 4 + 4 + 5 + 2 = 15 bytes
# 7 tokens over 21 bytes: a step costing b bits on every token scores 7 * b / 21 = b / 3 bits per byte.
COUNTED_TOKENS_PER_BYTE = 7 / 21

# The stand-in's target logit at each supervision step, every other logit 0: the target's probability is
# w / (w + V - 1) = 1/8 (uniform), 1/2, 3/4, so a token costs log2(8) = 3, 1 and log2(4/3) bits.
TARGET_WEIGHTS = (1.0, 7.0, 21.0)
BITS_PER_TOKEN = (3.0, 1.0, math.log2(4 / 3))


class KnownLossModel:
    """Stands in for GPT: model(x, y, n_sup, loss_reduction="none") -> per-token losses (N, B, T) of the logits
    above, scored at every position, ignored and special targets too (leaving them out is evaluate_bpb's job);
    diagnose(x, n) -> rows 10 * step + (1, 2, 3, 4) + x[0, 0] - 1, which tell the steps and the batches apart."""

    config = SimpleNamespace(n_sup_train=3)

    def __init__(self):
        self.n_sups, self.diagnosed = [], []

    def __call__(self, x, y, n_sup=None, loss_reduction="mean"):
        assert loss_reduction == "none"
        self.n_sups.append(n_sup)
        target = y.clamp(min=0)
        is_target = F.one_hot(target, V).bool()
        weights = TARGET_WEIGHTS[:n_sup or self.config.n_sup_train]
        return torch.stack([F.cross_entropy(torch.where(is_target, math.log(w), 0.0).view(-1, V), target.view(-1),
                                            reduction="none").view(y.shape) for w in weights])

    def diagnose(self, x, n):
        self.diagnosed.append(n)
        return torch.tensor([[10.0 * s + j + x[0, 0].item() - 1 for j in (1, 2, 3, 4)] for s in range(n)])


def test_every_step_is_the_sum_of_nats_over_the_bytes_of_the_counted_tokens_in_bits():
    model, batches = KnownLossModel(), iter(BATCHES)
    bpb, state = evaluate_bpb(model, batches, 2, TOKEN_BYTES)
    assert bpb == pytest.approx([b * COUNTED_TOKENS_PER_BYTE for b in BITS_PER_TOKEN], rel=1e-6)
    assert bpb == pytest.approx([1.0, 1 / 3, 0.13834], abs=1e-5)  # the same, as numbers
    assert model.n_sups == [None, None]  # n_sup=None: the model's own default, n_sup_train steps
    assert next(batches) is BATCHES[2]  # steps=2 batches read, no more


def test_a_long_evaluation_shows_its_progress_and_eta_in_a_log(monkeypatch, capsys):
    """base_loss printed nothing for minutes when its output went to a file: now a line every few seconds."""
    clock = [0.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)

    def slow_batches():  # each batch takes 6 s of the fake clock
        while True:
            clock[0] += 6.0
            yield BATCHES[0]
    evaluate_bpb(KnownLossModel(), slow_batches(), 10, TOKEN_BYTES)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 5, lines  # every 12 s (2 batches: the first update 10 s or more after the last line)
    for line, done in zip(lines, (2, 4, 6, 8, 10)):  # the ETA: the 6 s batches left, within a second
        seconds = 6 * done
        eta = re.fullmatch(rf"evaluating: {done}/10 batches \({10 * done}%\), {seconds // 60:02d}:{seconds % 60:02d} "
                           rf"elapsed, eta 00:(\d\d)", line)
        assert eta and abs(int(eta.group(1)) - 6 * (10 - done)) <= 1, line


def test_state_is_the_first_batchs_diagnostics_one_row_per_step():
    model = KnownLossModel()
    _, state = evaluate_bpb(model, iter(BATCHES), 2, TOKEN_BYTES)
    assert len(STATE_DIAGNOSTICS) == 4
    assert state == [[1, 2, 3, 4], [11, 12, 13, 14], [21, 22, 23, 24]]  # x[0, 0] = 1: the first batch's
    assert model.diagnosed == [3]  # once, over every step


def test_fewer_supervision_steps_give_the_first_steps_values():
    model = KnownLossModel()
    bpb, state = evaluate_bpb(model, lambda: iter(BATCHES), 2, TOKEN_BYTES, n_sup=2)  # a loader factory, as base_train
    assert bpb == pytest.approx([1.0, 1 / 3], rel=1e-6)
    assert state == [[1, 2, 3, 4], [11, 12, 13, 14]]
    assert model.n_sups == [2, 2] and model.diagnosed == [2]


@torch.no_grad()
def test_a_gpt_at_initialisation_scores_log2_vocab_bits_per_counted_token_at_every_step():
    """init_weights zeroes lm_head: every logit is 0, so every token costs ln(V) nats = 3 bits at every step."""
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=V, n_sup_train=3))
    model.init_weights()
    assert not model.lm_head.weight.any()
    bpb, state = evaluate_bpb(model, iter(BATCHES), 2, TOKEN_BYTES)
    assert bpb == pytest.approx([3 * COUNTED_TOKENS_PER_BYTE] * 3, rel=1e-6)
    torch.testing.assert_close(torch.tensor(state), model.diagnose(BATCHES[0][0], 3))


def test_a_loader_that_cannot_start_is_reported_as_the_evaluation_failing():
    def broken_loader():
        raise OSError("no val shard")
    with pytest.raises(RankFailure, match="evaluation failed: .*no val shard"):
        evaluate_bpb(KnownLossModel(), broken_loader, 2, TOKEN_BYTES)


# ---------------------------------------------------------------------------------------------------- its memory
LARGE_VOCAB = dict(sequence_len=64, vocab_size=8192, n_layer=2, n_head=1, n_kv_head=1, n_embd=64, n_loops=2,
                   n_sup_train=2)


def evaluation_peak(config, batch, dtype="float32"):
    """Peak bytes of the CPU tensors evaluate_bpb allocates (two batches; the model built before profiling, so its
    weights are not counted), from the profiler's "Total Allocated" (tests/test_memory.py's method)."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    model.eval()
    batches = [(torch.randint(0, config.vocab_size, (batch, config.sequence_len)),) * 2 for _ in range(2)]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        evaluate_bpb(model, iter(batches), 2, torch.ones(config.vocab_size, dtype=torch.long), autocast=autocast)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    return max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")


def test_evaluation_holds_one_chunk_of_logits_however_large_the_batch(monkeypatch):
    # it built three (B, T, vocab) float32 tensors per batch, which the memory plan never counted
    from nanochat.model import supervision
    config = tiny_config(**LARGE_VOCAB)
    monkeypatch.setattr(supervision, "HEAD_CHUNK_ELEMENTS", 32 * config.vocab_size)  # 32 rows of 256 or 512 a batch
    small, large = evaluation_peak(config, 4), evaluation_peak(config, 8)
    chunk_logits = 4 * 32 * config.vocab_size  # bytes of one chunk's float32 logits (1 MB; the batch's: 8 and 16 MB)
    assert large - small < chunk_logits, (small, large)  # measured: 0.2 MB more (the states); before, 25 MB


def test_evaluation_gives_the_losses_of_the_whole_batch_logits_exactly(monkeypatch):
    from nanochat.model import supervision
    from tests.support.helpers import random_model
    config = tiny_config(vocab_size=512, n_coda=1, n_sup_train=3)
    model = random_model(config, every_weight=True)
    idx, targets = torch.randint(0, 512, (4, 16)), torch.randint(0, 512, (4, 16))
    targets[0, :3] = -1
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            whole = model(idx, targets, loss_reduction="none").detach()  # with gradient: the whole batch's logits
            monkeypatch.setattr(supervision, "HEAD_CHUNK_ELEMENTS", 5 * config.vocab_size)
            with torch.no_grad():
                chunked = model(idx, targets, loss_reduction="none")
            monkeypatch.undo()
        assert torch.equal(chunked, whole)


@pytest.mark.parametrize("config, batch, dtype", [
    (dict(LARGE_VOCAB, vocab_size=512, n_embd=128, n_head=2, n_kv_head=2), 4, "float32"),
    (dict(LARGE_VOCAB, vocab_size=512, n_embd=128, n_head=2, n_kv_head=2), 4, "bfloat16"),
    (LARGE_VOCAB, 8, "float32"),  # the head's chunk dominates
    (LARGE_VOCAB, 8, "bfloat16"),
], ids=["fp32", "bf16", "large-vocab", "large-vocab-bf16"])
def test_the_plans_evaluation_estimate_is_within_35_percent_of_the_measured_peak(config, batch, dtype, monkeypatch):
    from nanochat.model import supervision
    from nanochat.train import memory
    monkeypatch.setattr(supervision, "HEAD_CHUNK_ELEMENTS", 32 * 8192)  # memory.py reads it from there too
    config = tiny_config(**config)
    estimate, measured = memory.evaluation_bytes(config, batch, dtype), evaluation_peak(config, batch, dtype)
    assert abs(estimate - measured) <= 0.35 * measured, f"estimate {estimate:,} vs measured {measured:,}"
    # and the plan's total holds evaluation's peak too: gradients freed, the weights and optimizer state kept
    parts = memory.estimate_memory(config, batch, dtype)
    training = ("grads", "activations", "logits", "transient", "evaluation")
    assert parts["total"] >= parts["total"] - sum(parts[k] for k in training) + estimate
