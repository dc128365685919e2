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


def test_drawn_step_counts_on_a_falling_loss_do_not_read_as_an_inversion(capsys):
    """Every batch in order (each step 2% under the one before), the loss falling over the run, and the deep steps drawn
    rarely (as lognormal_poisson draws them): their smoothed losses are older than their neighbours', which the check
    read as an inversion before it compared steps within a batch (dev/runcpu.sh warned at step 112 on every run)."""
    health = Health(window=50)
    for step in range(300):
        depth = 6 if step % 10 == 0 else 1 + step % 3  # 6 steps one batch in 10, else 1-3
        level = 6.0 * 0.997 ** step
        health.check(step, [level * 0.98 ** s for s in range(depth)], grad_norm=1.0)
    assert capsys.readouterr().out == ""


def test_a_later_step_slightly_worse_than_the_one_before_it_is_not_a_broken_run(capsys):
    health = Health(window=3)
    for step in range(10):  # step 3 0.1% over step 2 in every batch: a recursion past its best step, as on text
        health.check(step, [5.7, 5.6, 5.6056], grad_norm=1.0)
    assert capsys.readouterr().out == ""
    for step in range(10, 20):  # 5% over: broken, warned once the smoothed rise has passed the tolerance 3 steps
        health.check(step, [5.7, 5.6, 5.88], grad_norm=1.0)
    assert "WARNING step 13: supervision order inverted for 3 steps" in capsys.readouterr().out
