"""
Per-token adaptive halting at inference, and the halting head's loss: kept out of the model file (as TinyRecursiveModels
keeps its loss head and halting apart), imported relatively so the Hugging Face export carries it beside gpt.py.

After each supervision step s a rule scores every position still refining: how much step s changed it, or how likely
another step is to pay. A position whose score falls below the threshold halts: it keeps its answer (and so its
logits) from step s, and later steps read its keys and values from step s. Step 0 is the input (y_0 = x), so a
position can halt after step 1. Threshold 0 never halts (every score is >= 0); an infinite one halts everything
after step 1.
"""

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F


class Draft:
    """One step's answer y, with its logits computed only if a rule reads them."""

    def __init__(self, model, y):
        self.model, self.y = model, y

    @cached_property
    def logits(self):
        return self.model.head(self.y)

    def narrowed(self, rows):
        """The draft of these rows only, its logits kept if computed."""
        draft = Draft(self.model, self.y[rows])
        if "logits" in self.__dict__:
            draft.logits = self.logits[rows]
        return draft


def kl_score(model, previous, current):
    """KL(p_s || p_{s-1}) per position in nats: Huginn's training-free exit rule."""
    log_p, log_q = F.log_softmax(current.logits, dim=-1), F.log_softmax(previous.logits, dim=-1)
    # clamped: rounding can dip below 0 on two equal distributions, and threshold 0 must never halt
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp(min=0)


def rms_score(model, previous, current):
    """||y_s - y_{s-1}|| / ||y_{s-1}|| per position: the step's relative update, no head needed."""
    return (current.y - previous.y).float().norm(dim=-1) / previous.y.float().norm(dim=-1)


def head_score(model, previous, current):
    """1 - sigmoid(halt_head(norm(y_s))): the learned probability that another step still lowers this token's loss."""
    return 1 - model.halt_probability(current.y)


HALTING_RULES = {"kl": kl_score, "rms": rms_score, "head": head_score}
HALT_MARGIN = 0.005  # nats: a next step 'still pays' for a token when it lowers its loss by more than this (Ouro)


def halt_targets(previous_losses, losses):
    """Per token: the step from previous_losses to losses no longer paid (gained at most HALT_MARGIN nats)."""
    return previous_losses - losses <= HALT_MARGIN


@dataclass(frozen=True)
class Halting:
    """A halting rule and its threshold: 'kl:0.0005' halts a position once KL(p_s || p_{s-1}) < 0.0005."""
    rule: str
    threshold: float

    def __str__(self):
        return f"{self.rule}:{self.threshold:g}"

    @classmethod
    def parse(cls, text):
        """'RULE:THRESHOLD' -> Halting; a ValueError saying what is wrong otherwise."""
        rule, sep, number = str(text).partition(":")
        try:
            threshold = float(number)
        except ValueError:
            threshold = None
        if not sep or rule not in HALTING_RULES or threshold is None or not threshold >= 0:
            raise ValueError(f"halting rule {text!r}: write RULE:THRESHOLD with RULE one of {', '.join(HALTING_RULES)} "
                             f"and THRESHOLD a number >= 0 (inf allowed), e.g. kl:0.0005")
        return cls(rule, threshold)


def check_halting(model, halting):
    """halting, if this model can run it (rule 'head' needs a halting head); a ValueError otherwise."""
    if halting.rule == "head" and not model.config.halt_head:
        raise ValueError(f"halting rule {halting}: this model has no halting head (GPTConfig.halt_head); "
                         f"use kl or rms")
    if halting.rule == "kl" and model.config.n_coda:
        raise ValueError(f"halting rule {halting} compares every step's logits, which with a coda would run the "
                         f"coda at every step; use rms or head")
    return halting


@torch.no_grad()
def forward_halting(model, idx, halting, kv_cache, n_sup=None):
    """(logits (B, T, V), steps (B, T)): each position's logits from the step it halted at (see `Halting`) and
    the number of steps it ran (what decoding it alone would run). kv_cache: an engine KVCache, a fresh one for
    a whole sequence; from the step after a position halts, it gives that position's keys and values from the
    step it halted at. Rows all halted skip the remaining steps (the cache repeats their last step's keys).
    kv_cache=None: the same decisions and kept answers, but every position runs all n_sup steps and later tokens
    read its keys and values from every step, the exact computation that holding approximates (to measure it)."""
    n_sup = n_sup or model.config.n_sup_inference
    score = HALTING_RULES[check_halting(model, halting).rule]
    if hasattr(kv_cache, "narrow"):
        return forward_halting_rows(model, idx, score, halting.threshold, kv_cache, n_sup)
    x = model.embed(idx, kv_cache)
    halted = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
    steps = torch.zeros(idx.shape, dtype=torch.long, device=idx.device)
    kept, previous = x, Draft(model, x)
    for s, (y, _) in enumerate(model.refine(idx, n_sup, kv_cache, x=x), start=1):
        kept = torch.where(halted[..., None], kept, y)
        steps += ~halted
        current = Draft(model, y)
        halted = halted | (score(model, previous, current) < halting.threshold)
        previous = current
        if kv_cache is None:
            continue
        per_step, prelude = model.slots_per_step(), model.config.n_prelude
        if halted.all() and s < n_sup:
            kv_cache.repeat_step(prelude + s * per_step, prelude + n_sup * per_step, per_step, idx.size(1))
            break
        kv_cache.hold(halted, per_step)
    if kv_cache is not None:
        kv_cache.hold(None, None)  # the coda runs once, on every position's kept answer
    logits = model.head(model.apply_coda(kept, kv_cache, n_sup))
    if kv_cache is not None:
        kv_cache.advance(idx.size(1))
    return logits, steps


@torch.no_grad()
def forward_halting_rows(model, idx, score, threshold, kv_cache, n_sup):
    """forward_halting for one token per row (decoding) over a cache that can narrow to some of its rows
    (engine.RowCache): a row that halts leaves the recursion at once, so later steps compute only the rows still
    refining; the halted row's later slots get the keys and values of the step it halted at, as holding gives."""
    if idx.size(1) != 1:
        raise ValueError(f"forward_halting_rows decodes one token per row; got {idx.size(1)}")
    x = model.embed(idx, kv_cache)
    B, per_step, prelude = idx.size(0), model.slots_per_step(), model.config.n_prelude
    steps = torch.zeros(idx.shape, dtype=torch.long, device=idx.device)
    previous = Draft(model, x)
    active = torch.arange(B, device=idx.device)  # the rows still refining, among the batch's
    states, going = model.refine(idx, n_sup, kv_cache, x=x), None
    try:
        for s in range(1, n_sup + 1):
            y, _ = states.send(going) if s > 1 else next(states)
            if s == 1:
                kept = y.clone()  # in the state's dtype, as forward_halting keeps it
            kept[active], steps[active] = y, s
            current = Draft(model, y)
            halted = (score(model, previous, current) < threshold)[:, 0]
            if s == n_sup or not halted.any():
                previous, going = current, None
                continue
            kv_cache.repeat_step(prelude + s * per_step, prelude + n_sup * per_step, per_step, 1, active[halted])
            if halted.all():
                break
            going = (~halted).nonzero()[:, 0]
            active = active[going]
            kv_cache.narrow(active)
            previous = current.narrowed(going)
    finally:
        states.close()
        kv_cache.narrow(None)
    logits = model.head(model.apply_coda(kept, kv_cache, n_sup))
    kv_cache.advance(1)
    return logits, steps


def halt_head_loss(model, previous_y, previous_losses, losses, targets):
    """BCE of the halting head on step s-1's answer (detached: the head learns, the model is untouched) towards
    'halt', i.e. step s lowered that token's loss by no more than HALT_MARGIN."""
    halt = halt_targets(previous_losses, losses).float()
    logits = model.halt_head(F.rms_norm(previous_y.detach(), (previous_y.size(-1),))).float().squeeze(-1)
    valid = (targets != -1).float()
    bce = F.binary_cross_entropy_with_logits(logits, halt, reduction="none")
    return (bce * valid).sum() / valid.sum().clamp(min=1)


def frozen_halt_head_loss(model, idx, targets, n_sup=None):
    """(bce, halt_rate) on a batch with the model frozen (Ouro's second stage, scripts.halt_train): the trunk runs
    without gradients, and only the head's BCE (halt_head_loss, mean over the steps that have a next one) has a
    graph. halt_rate: the fraction of 'halt' targets; its entropy is what a head blind to y would score."""
    with torch.no_grad():
        states = [y for y, _ in model.refine(idx, n_sup or model.config.n_sup_inference)]
        losses = [model.token_losses(y, targets) for y in states]
    pairs = range(1, len(states))
    bce = torch.stack([halt_head_loss(model, states[s - 1], losses[s - 1], losses[s], targets) for s in pairs])
    valid = targets != -1
    halts = sum((halt_targets(losses[s - 1], losses[s]) & valid).sum() for s in pairs)
    return bce.mean(), halts / (valid.sum() * len(pairs)).clamp(min=1)
