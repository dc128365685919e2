"""
FLOPs per token of a model's training step or inference forward: what MFU, the plan's time and cost, and compare's
budgets count. A training step's supervision steps may be drawn (GPTConfig.sample_n_sup, the step-count curriculum):
n_sup is then the steps this step drew, or a plan's expectation (depth.mean_train_depth), a float.
"""

import functools

from nanochat.model.gpt import GPTConfig
from nanochat.train.depth import mean_train_depth


def block_params(model):
    """Weights of one block's matrices (the per-channel decays of state_update="decay" cost no matmul)."""
    return sum(p.numel() for p in model.transformer.h[0].parameters() if p.ndim == 2)


def estimate_flops(model, n_sup=None, backward=True):
    """FLOPs per token of one training step (backward=True) or one inference forward (backward=False) of n_sup
    supervision steps (default: the config's n_sup_train, or n_sup_inference; a float is an expectation).

    Counts every block application (with and without gradient, every loop, sweep and supervision step) at 2 FLOPs per
    weight forward and 4 backward, plus attention (nanochat's 12*h*q*t per layer, full context), plus the lm_head of
    every supervision step, plus the halting head (if any) of every step. The prelude runs once; the coda runs once at
    inference (on the last step's answer) but at every step in training, whose loss reads every step's logits.
    Activation-checkpoint recomputation is not counted (recompute_flops is): MFU reports model FLOPs, so turning
    recomputation on shows up honestly as lower MFU.
    """
    c = model.config
    n_sup = n_sup or (c.n_sup_train if backward else c.n_sup_inference)
    head_dim = c.n_embd // c.n_head
    applications = c.n_layer * (c.n_loops + 1)
    forward_app = 2 * block_params(model) + 4 * c.n_head * head_dim * c.sequence_len
    grad_mult = 3 if backward else 1
    grad_sweeps, nograd_sweeps = (1, c.T_recursion - 1)
    per_step = applications * forward_app * (grad_mult * grad_sweeps + nograd_sweeps)
    per_step += grad_mult * 2 * model.lm_head.weight.numel()
    if c.halt_head:  # training it costs per-token losses (one more lm_head forward) and, on a detached y, its
        # weight gradients only; counted at every step although the last step has no next one to learn from
        halt = 2 * model.halt_head.weight.numel()
        per_step += 2 * model.lm_head.weight.numel() + 2 * halt if backward else halt
    coda = c.n_coda * forward_app
    if backward:
        per_step += grad_mult * coda + (coda if c.halt_head else 0)  # + the per-token losses' coda forward
    return n_sup * per_step + grad_mult * c.n_prelude * forward_app + (0 if backward else coda)


def recompute_flops(model, n_sup=None):
    """FLOPs per token that activation checkpointing (GPTConfig.activation_checkpointing, per layer visit) adds to a
    training step of n_sup supervision steps: one more forward of every layer visit with gradient (the head and the
    no-gradient sweeps are not recomputed). Counted whether or not the config turns it on: the plan weighs it."""
    c = model.config
    n_sup = n_sup or c.n_sup_train
    head_dim = c.n_embd // c.n_head
    forward_app = 2 * block_params(model) + 4 * c.n_head * head_dim * c.sequence_len
    return n_sup * c.n_layer * (c.n_loops + 1) * forward_app


@functools.lru_cache(maxsize=256)
def _mean_depth(sample_n_sup, n_sup_train, warmup, num_iterations):
    config = GPTConfig(vocab_size=1, n_sup_train=n_sup_train, sample_n_sup=sample_n_sup)
    return mean_train_depth(config, warmup, num_iterations)


def planned_depth(config, warmup=0.0, num_iterations=1):
    """The mean supervision steps a run of num_iterations optimizer steps trains under --n_sup_warmup=warmup (the
    draws of depth.train_depth, averaged; n_sup_train when nothing is drawn). Cached: a plan asks many times."""
    return _mean_depth(config.sample_n_sup, config.n_sup_train, float(warmup), max(1, int(num_iterations)))


def run_flops_per_token(model, warmup=0.0, num_iterations=1):
    """Training FLOPs per token of a whole run, on average: estimate_flops at the run's planned_depth."""
    return estimate_flops(model, n_sup=planned_depth(model.config, warmup, num_iterations))
