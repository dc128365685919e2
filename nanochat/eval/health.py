"""
The health of a training run: per-supervision-step losses smoothed (for the log line, the summary and the plots), and
the warnings printed while training when the smoothed losses or the gradient norm leave the guides' success criteria.
"""

from nanochat.common import print0


class LossSmoother:
    """Exponential moving average of a list of values, debiased as nanochat does so early values are not pulled to 0.
    Each position averages the updates that had it: with sample_n_sup a step trains 1 .. 2N-1 supervision steps."""

    def __init__(self, beta=0.9):
        self.beta, self.count, self.total = beta, [], []

    def update(self, values):
        for i, v in enumerate(values):
            if i == len(self.total):
                self.total.append(0.0)
                self.count.append(0)
            self.count[i] += 1
            self.total[i] = self.beta * self.total[i] + (1 - self.beta) * v
        return self.value

    @property
    def value(self):
        return [t / (1 - self.beta ** c) for t, c in zip(self.total, self.count)]


def smooth(series, beta):
    """Each point of a series of value lists replaced by its debiased EMA so far."""
    smoother = LossSmoother(beta)
    return [smoother.update(values) for values in series]


# a later step counts as worse than the one before it when, paired within the same batches, it is this much higher
# (relative): a broken run's steps differ by several %, while a text recursion past its best step rises by ~0.05%
ORDER_TOLERANCE = 0.01


class Health:
    """The guides' success criteria, watched every step: one warning per problem per 100 steps, with what to try."""

    def __init__(self, window=50):
        self.window, self.inverted_for, self.last_warned = window, 0, {}
        self.smoother, self.rises = LossSmoother(0.9), LossSmoother(0.9)

    def warn(self, kind, step, message):
        if step - self.last_warned.get(kind, -10**9) >= 100:
            self.last_warned[kind] = step
            print0(f"WARNING step {step}: {message}")

    def check(self, step, step_losses, grad_norm):
        smoothed = self.smoother.update(step_losses)  # so one noisy batch does not count as an inversion
        # each step against the one before it in the same batch: with drawn step counts a deep step trains rarely, and
        # its smoothed loss, older than its neighbour's, read a falling loss as an inversion (every dev/runcpu.sh run)
        rises = self.rises.update([later - earlier for earlier, later in zip(step_losses, step_losses[1:])])
        inverted = any(rise > ORDER_TOLERANCE * earlier for rise, earlier in zip(rises, smoothed))
        self.inverted_for = self.inverted_for + 1 if inverted else 0
        if self.inverted_for >= self.window:
            order = " ".join(f"{l:.3f}" for l in smoothed)
            self.warn("order", step, f"supervision order inverted for {self.inverted_for} steps (smoothed per-step "
                      f"losses {order}; a step over {ORDER_TOLERANCE:.0%} worse than the one before it, in the same "
                      f"batches): later steps should be lower. Try a lower --matrix_lr (2x), a longer warmup "
                      f"(--warmup_steps), and check --grad_clip=1.0 and the preset.")
        if grad_norm > 20:
            self.warn("grad", step, f"gradient norm {grad_norm:.1f} > 20: training may diverge. Lower --matrix_lr "
                      f"or switch to a milder --preset (extreme -> aggressive).")
