"""nanochat/eval/health.py: the per-supervision-step loss smoothing, and the warnings watched on it while training."""

import pytest

from nanochat.eval.health import Health, LossSmoother


def test_smoothing_follows_a_varying_number_of_supervision_steps():
    ema = LossSmoother(0.5)
    ema.update([4.0, 2.0])
    ema.update([2.0])  # a step that trained one supervision step leaves position 1 alone
    assert ema.value == pytest.approx([(0.25 * 4 + 0.5 * 2) / 0.75, 2.0])
    ema.update([2.0, 1.0, 3.0])
    assert len(ema.value) == 3 and ema.value[2] == pytest.approx(3.0)
    assert ema.value[1] == pytest.approx((0.25 * 2 + 0.5 * 1) / 0.75)


def test_an_inverted_order_warns_after_the_window_and_then_once_per_100_steps(capsys):
    health = Health(window=3)
    for step in (1, 2):
        health.check(step, [2.0, 3.0], grad_norm=1.0)
    assert capsys.readouterr().out == ""  # inverted for fewer steps than the window
    health.check(3, [2.0, 3.0], grad_norm=1.0)
    assert "WARNING step 3: supervision order inverted for 3 steps" in capsys.readouterr().out
    for step in range(4, 103):
        health.check(step, [2.0, 3.0], grad_norm=1.0)
    assert capsys.readouterr().out == ""
    health.check(103, [2.0, 3.0], grad_norm=1.0)
    assert "WARNING step 103: supervision order inverted for 103 steps" in capsys.readouterr().out


def test_one_inverted_batch_in_a_good_run_is_smoothed_away_and_a_large_gradient_norm_warns(capsys):
    health = Health(window=1)
    for step in range(1, 21):
        health.check(step, [3.0, 2.0], grad_norm=1.0)
    health.check(21, [2.0, 3.0], grad_norm=1.0)  # smoothed: 2.9 > 2.1 still in order
    assert capsys.readouterr().out == ""
    health.check(22, [3.0, 2.0], grad_norm=25.0)
    assert capsys.readouterr().out == "WARNING step 22: gradient norm 25.0 > 20: training may diverge. Lower " \
                                      "--matrix_lr or switch to a milder --preset (extreme -> aggressive).\n"
