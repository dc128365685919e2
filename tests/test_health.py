"""nanochat/health.py: the per-supervision-step loss smoothing behind the health warnings, log line and summary."""

import pytest

from nanochat.health import LossSmoother


def test_smoothing_follows_a_varying_number_of_supervision_steps():
    ema = LossSmoother(0.5)
    ema.update([4.0, 2.0])
    ema.update([2.0])  # a step that trained one supervision step leaves position 1 alone
    assert ema.value == pytest.approx([(0.25 * 4 + 0.5 * 2) / 0.75, 2.0])
    ema.update([2.0, 1.0, 3.0])
    assert len(ema.value) == 3 and ema.value[2] == pytest.approx(3.0) and ema.value[1] == pytest.approx((0.25 * 2 + 0.5 * 1) / 0.75)
