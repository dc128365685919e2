"""dev/readout.py: bpb by budget with a halting readout, against numbers worked by hand and against the product's
evaluate_bpb_halting on a model."""

import math

import pytest
import torch

from dev.readout import PRODUCT_HALTING, bpb_by_budget, halt_steps, step_losses_and_scores, verdict
from nanochat.eval.loss_eval import evaluate_bpb_halting
from nanochat.model.halting import Halting
from tests.support import helpers


def test_each_token_keeps_the_loss_of_the_step_it_halted_at():
    # 3 steps x 2 tokens of 1 byte each; token 0's score falls below 0.5 at step 2, token 1's never
    losses = torch.tensor([[3.0, 1.0], [2.0, 2.0], [5.0, 4.0]], dtype=torch.float64)
    scores = torch.tensor([[0.9, 0.9], [0.1, 0.8], [0.0, 0.7]])
    nbytes = torch.ones(2, dtype=torch.float64)
    halted = halt_steps(scores, 0.5)
    assert halted.tolist() == [1, 3]
    ln2 = math.log(2)
    assert bpb_by_budget(losses, nbytes, halted) == pytest.approx([4 / (2 * ln2), 4 / (2 * ln2), 6 / (2 * ln2)])
    assert bpb_by_budget(losses, nbytes) == pytest.approx([4 / (2 * ln2), 4 / (2 * ln2), 9 / (2 * ln2)])


def test_the_verdict_reads_the_rise_past_n_and_the_best_budget_with_ties_to_the_later():
    assert verdict([3.0, 2.0, 2.5, 2.6, 2.6, 2.7, 2.8, 2.9], 2) == pytest.approx((0.6, 0.9, 2))
    assert verdict([3.0, 2.0, 2.0, 2.0], 1)[2] == 4  # flat from budget 2: it holds


def test_the_readout_equals_the_products_halting_without_held_keys():
    model = helpers.random_model(helpers.tiny_config(n_loops=2, n_sup_train=2), every_weight=True).eval()
    g = torch.Generator().manual_seed(5)
    V, T = model.config.vocab_size, model.config.sequence_len
    rows = [(torch.randint(0, V, (2, T), generator=g), torch.randint(-1, V, (2, T), generator=g)) for _ in range(2)]
    token_bytes = torch.randint(0, 3, (V,), generator=g)  # some tokens count 0 bytes, as special tokens do
    losses, scores, nbytes = step_losses_and_scores(model, iter(rows), 2, token_bytes, 6, ["kl", "rms"])
    for halting in (Halting.parse(PRODUCT_HALTING), Halting("kl", 0.02), Halting("rms", 0.3)):
        halted = halt_steps(scores[halting.rule], halting.threshold)
        ours = bpb_by_budget(losses, nbytes, halted)
        for budget in (1, 3, 6):
            theirs, _ = evaluate_bpb_halting(model, iter(rows), 2, token_bytes, halting, n_sup=budget,
                                             hold_keys=False)
            assert ours[budget - 1] == pytest.approx(theirs, rel=1e-5), (halting, budget)
    assert 1 < (halted + 1).clamp(max=6).double().mean() < 6  # the last rule halts some tokens, not all
