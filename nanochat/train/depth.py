"""
How many supervision steps each optimizer step trains: the model's fixed n_sup_train, or a draw (GPTConfig.sample_n_sup)
whose mean is n_sup_train, capped by the step-count curriculum (base_train --n_sup_warmup). A draw is a function of
the optimizer step alone, so every rank and micro-batch agrees and a resumed run draws what the first run drew.
"""

import math

import torch

from nanochat.model.gpt import N_SUP_SAMPLERS

LOGNORMAL_SIGMA = 0.5  # Huginn's and looped_nanochat's spread of log(rate)


def uniform_n_sup(n, generator):
    """Uniform on 1 .. 2n-1: mean n."""
    return int(torch.randint(1, 2 * n, (), generator=generator))


def lognormal_poisson_n_sup(n, generator):
    """Huginn's log-normal Poisson: 1 + Poisson(exp(tau)), tau ~ N(log(n-1) - sigma^2/2, sigma), so the mean is n;
    a heavier tail than uniform (deeper draws, more of them near n), capped at 4n."""
    if n == 1:
        return 1
    tau = torch.normal(math.log(n - 1) - LOGNORMAL_SIGMA ** 2 / 2, LOGNORMAL_SIGMA, (), generator=generator)
    return min(4 * n, 1 + int(torch.poisson(tau.exp(), generator=generator)))


# name -> (draw(n, generator), the deepest it can draw for n = n_sup_train: what the memory estimate plans for)
SAMPLERS = {"uniform": (uniform_n_sup, lambda n: 2 * n - 1),
            "lognormal_poisson": (lognormal_poisson_n_sup, lambda n: 4 * n if n > 1 else 1)}
assert tuple(SAMPLERS) == N_SUP_SAMPLERS, "gpt.N_SUP_SAMPLERS names the samplers a config may ask for"


def sampler(config):
    return SAMPLERS["uniform" if config.sample_n_sup is True else config.sample_n_sup]


def deepest_train_depth(config):
    """The most supervision steps one optimizer step can train (the memory estimate's worst batch)."""
    return sampler(config)[1](config.n_sup_train) if config.sample_n_sup else config.n_sup_train


def curriculum_cap(config, step, warmup, num_iterations):
    """The step-count curriculum (looped_nanochat's loop warmup): at most 1 supervision step at first, the cap rising
    linearly, by n_sup_train every fraction `warmup` of the run (n_sup_train + 1 at `warmup`, 1 + n_sup_train / warmup
    at the end, so a drawn count's tail opens late); None (no cap) with warmup 0."""
    return 1 + int(config.n_sup_train * step / (warmup * num_iterations)) if warmup else None


def train_depth(config, step, warmup=0.0, num_iterations=1):
    """Supervision steps to train at optimizer step `step`: n_sup_train or its draw, under the curriculum's cap."""
    n_sup = sampler(config)[0](config.n_sup_train, torch.Generator().manual_seed(step)) if config.sample_n_sup \
        else config.n_sup_train
    cap = curriculum_cap(config, step, warmup, num_iterations)
    return n_sup if cap is None else min(n_sup, cap)


def mean_train_depth(config, warmup=0.0, num_iterations=1, start=0):
    """The mean supervision steps trained over steps start .. num_iterations-1: what a plan's time and FLOPs count."""
    if not config.sample_n_sup and not warmup:
        return float(config.n_sup_train)
    steps = range(start, num_iterations)
    return sum(train_depth(config, s, warmup, num_iterations) for s in steps) / max(1, len(steps))
