"""nanochat/train/depth.py: how many supervision steps each optimizer step trains."""

import pytest

from nanochat.train.depth import curriculum_cap, deepest_train_depth, mean_train_depth, train_depth
from tests.support.helpers import tiny_config


def test_sampled_supervision_depth_is_uniform_with_the_trained_mean_and_fixed_per_step():
    config = tiny_config(n_loops=1, n_sup_train=4, sample_n_sup=True)
    depths = [train_depth(config, step) for step in range(2000)]
    assert set(depths) == set(range(1, 8))
    assert abs(sum(depths) / len(depths) - 4) < 0.15
    assert [train_depth(config, step) for step in range(50)] == depths[:50]  # a resumed run draws the same
    assert {train_depth(tiny_config(n_sup_train=3, sample_n_sup=False), s) for s in range(20)} == {3}


def test_lognormal_poisson_depth_has_the_trained_mean_a_longer_tail_and_the_planned_cap():
    config = tiny_config(n_loops=1, n_sup_train=4, sample_n_sup="lognormal_poisson")
    depths = [train_depth(config, step) for step in range(4000)]
    assert abs(sum(depths) / len(depths) - 4) < 0.15 and min(depths) == 1
    assert max(depths) > 7 and max(depths) <= deepest_train_depth(config) == 16  # deeper than uniform's 7
    assert [train_depth(config, step) for step in range(50)] == depths[:50]  # a resumed run draws the same
    assert deepest_train_depth(config.replace(sample_n_sup=True)) == 7
    one = config.replace(n_sup_train=1)  # one step (the plain model) draws one: its memory plan is a single step's
    assert {train_depth(one, s) for s in range(50)} == {1} and deepest_train_depth(one) == 1


def test_the_curriculum_caps_the_draw_from_one_step_rising_by_n_sup_train_every_warmup_fraction():
    config = tiny_config(n_loops=1, n_sup_train=4, sample_n_sup="lognormal_poisson")
    # 1000 steps, warmup 0.5: the cap is 1 at step 0, 2 from step 125, n_sup_train + 1 = 5 at 500, 8 at step 999
    assert [curriculum_cap(config, s, 0.5, 1000) for s in (0, 124, 125, 499, 500, 999)] == [1, 1, 2, 4, 5, 8]
    assert curriculum_cap(config, 10, 0.0, 1000) is None
    capped = [train_depth(config, s, 0.5, 1000) for s in range(1000)]
    assert capped == [min(train_depth(config, s), curriculum_cap(config, s, 0.5, 1000)) for s in range(1000)]
    assert set(capped[:125]) == {1} and max(capped[500:]) > 4  # the tail opens past the warmup
    # a plan's mean is the mean of the steps the run will draw; without a draw or a cap it is n_sup_train
    assert mean_train_depth(config, 0.5, 1000) == pytest.approx(sum(capped) / 1000)
    assert mean_train_depth(config, 0.5, 1000, start=500) == pytest.approx(sum(capped[500:]) / 500)
    assert mean_train_depth(config.replace(sample_n_sup=False)) == 4.0
    assert 2.0 < mean_train_depth(config, 0.5, 1000) < 4.0  # the curriculum trains fewer steps early
