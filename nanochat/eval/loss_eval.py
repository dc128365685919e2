"""Bits per byte for every supervision step: a loss that does not depend on the tokenizer, so refinement is measured
on held-out text."""

import math

import torch

from nanochat.collectives import RankFailure, raise_if_any_rank_failed, reduce_with_flags
from nanochat.common import autocast_for, distributed, print0, progress_bar
from nanochat.data.dataloader import evaluation_batches, evaluation_size
from nanochat.model import supervision
from nanochat.model.engine import KVCache
from nanochat.model.halting import forward_halting
from nanochat.train.sharding import is_sharded


class EvaluationStopped(Exception):
    """A stop was asked for (a signal) during an evaluation; raised on every rank together."""


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes, n_sup=None, autocast=None, stop=None):
    """(bpb, state): per supervision step, sum of per-token nats over sum of bytes of the target tokens, in bits;
    and the recursion's state diagnostics per step (supervision.STATE_DIAGNOSTICS) on rank 0's first batch, as lists.

    Special tokens have byte length 0 and are left out of both sums; targets of -1 (ignored) likewise.
    batches: an iterator of (x, y), or a function returning one (called inside the failure guard, so a loader that
    cannot start on one rank counts as that rank's failure). Under DDP the sums are reduced across ranks, so every
    rank returns the same numbers; a failure on any rank raises RankFailure on every rank, naming rank and cause.
    stop: a function saying whether this rank was asked to stop; after every batch the ranks agree on it (one small
    all_reduce, none on one process), and a stop on any rank raises EvaluationStopped on every rank.
    """
    n = n_sup or model.config.n_sup_train  # what model(x, y) runs when n_sup is None
    # nats of each step, bytes, then the state diagnostics (supervision.STATE_DIAGNOSTICS per step)
    width = len(supervision.STATE_DIAGNOSTICS)
    sums = torch.zeros(n + 1 + width * n, dtype=torch.float64, device=token_bytes.device)
    diagnosing = not distributed() or torch.distributed.get_rank() == 0
    error, failed, stopped = None, [], []
    for i in progress_bar(range(steps), desc="evaluating", unit="batches", delay=3, leave=False):
        try:
            if i == 0:
                batches = batches() if callable(batches) else batches
            x, y = next(batches)
            with autocast or torch.autocast(x.device.type, enabled=False):
                losses = model(x, y, n_sup=n_sup, loss_reduction="none")  # (N, B, T)
                if i == 0 and (diagnosing or is_sharded(model)):  # sharded: every rank takes part in the gathers
                    diagnostics = model.diagnose(x, n).flatten()
                    if diagnosing:
                        sums[n + 1:] = diagnostics
            valid = y >= 0
            num_bytes = torch.where(valid, token_bytes[y.clamp(min=0)], 0)
            counted = num_bytes > 0
            sums[:n] += (losses.double() * counted).sum(dim=(1, 2))
            sums[n] += num_bytes.sum()
        except Exception as e:  # noqa: BLE001 - reported below on every rank, so no rank waits for this one
            error = e
        if stop is not None:
            _, (failed, stopped) = reduce_with_flags(sums.new_zeros(0), [error is not None, stop()])
        if failed or stopped or (stop is None and error is not None):
            break
    if not (failed or stopped):
        sums, (failed,) = reduce_with_flags(sums, [error is not None])  # the one collective, success or not
    raise_if_any_rank_failed(error, "evaluation", failed)
    if stopped:
        raise EvaluationStopped()
    nats, nbytes = sums[:n], sums[n]
    state = sums[n + 1:].view(n, width).tolist()  # rank 0's alone: the others added zeros
    return [(v / (math.log(2) * nbytes)).item() for v in nats], state


def format_state(state):
    """'rms y 7.7 12.1 | rms update 4.2 5.0 | cos(update, y) 0.66 0.94': does the recursion settle or keep moving?"""
    rms_y, rms_update, cos = ([row[i] for row in state] for i in (0, 2, 3))
    numbers = lambda values, digits: " ".join(f"{v:.{digits}f}" for v in values)
    return f"rms y {numbers(rms_y, 2)} | rms update {numbers(rms_update, 3)} | cos(update, y) {numbers(cos, 2)}"


def refinement(values):
    """supervision.refinement for reports: 0 for None or [] (a skipped evaluation) and for a first value of 0, where
    supervision.refinement would raise. Kept apart because that one must not branch: on a tensor a branch is a host
    sync."""
    return supervision.refinement(values) if values and values[0] else 0.0


def step_name(s):
    """The name of supervision step s (0-based): numbered from 1 everywhere a person reads it, as base_loss, the hops
    tables and the viewer number them."""
    return f"step {s + 1}"


def format_steps(values, digits=4, names=False):
    """'2.70 > 2.64 < 2.65': per-step values joined by their true order, so an inversion is visible at a glance."""
    parts = [f"{step_name(s)} {v:.{digits}f}" if names else f"{v:.{digits}f}" for s, v in enumerate(values)]
    signs = [">" if a > b else "<" if a < b else "=" for a, b in zip(values, values[1:])]
    return parts[0] + "".join(f" {sign} {part}" for sign, part in zip(signs, parts[1:])) if parts else ""


def validation_bpb(model, tokenizer, run_config, device, rank, world_size, token_bytes, stop=None, batches=None):
    """Validation bpb per supervision step of a training run's model (run_config: its train_config.RunConfig), and the
    state diagnostics; printed. The same --eval_tokens rows on any number of processes (dataloader.evaluation_rows).
    A failure on any rank is reported and skipped by every rank together: (None, None). stop: as evaluate_bpb.
    batches: (a function returning this rank's batches, how many) of other validation data (chat_sft's)."""
    B, T = run_config.device_batch_size, run_config.max_seq_len
    make, steps = batches or (lambda: evaluation_batches(tokenizer, B, T, "val", run_config.eval_tokens, rank,
                                                         world_size, device),
                              evaluation_size(run_config.eval_tokens, B, T, world_size)[1])
    try:
        model.eval()
        bpb, state = evaluate_bpb(model, make, steps, token_bytes,
                                  autocast=autocast_for(run_config.device_type, run_config.dtype), stop=stop)
        print0(f"validation bpb per step: {format_steps(bpb)} | refinement "
               f"{100 * refinement(bpb):.1f}%")
        if model.config.n_loops:  # a plain GPT has no recursion: its residual stream's numbers would mislead
            print0(f"recursion state per step: {format_state(state)}")
        return bpb, state
    except RankFailure as e:  # raised on every rank alike: all skip, none waits in a collective
        print0(f"WARNING: {e}; skipped on every rank, training goes on")
        return None, None
    finally:
        model.train()


@torch.no_grad()
def evaluate_bpb_halting(model, batches, steps, token_bytes, halting, n_sup=None, autocast=None, hold_keys=True):
    """(bpb, mean_steps) with per-token adaptive halting (halting.Halting): each token's loss from the logits of the
    step it halted at, and the supervision steps it ran, averaged over the tokens bpb counts: exactly the steps decoding
    with halting runs for them. batches, steps, n_sup (default n_sup_inference) and DDP as evaluate_bpb.
    hold_keys=False: later tokens read a halted token's keys and values from every step, not from the step it halted
    at (halting.forward_halting without a cache): the reference that measures what the hold costs."""
    n = n_sup or model.config.n_sup_inference
    sums = torch.zeros(4, dtype=torch.float64, device=token_bytes.device)  # nats, bytes, steps, tokens
    error = None
    try:
        batches = batches() if callable(batches) else batches
        for _ in progress_bar(range(steps), desc=f"evaluating {halting}", unit="batches", delay=3, leave=False):
            x, y = next(batches)
            cache = KVCache(model.num_attention_slots(n), x.size(0), x.size(1)) if hold_keys else None  # whole rows
            with autocast or torch.autocast(x.device.type, enabled=False):
                logits, used = forward_halting(model, x, halting, cache, n_sup=n)
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-1,
                                                       reduction="none").view(y.shape)
            num_bytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0)
            counted = num_bytes > 0
            sums += torch.stack([(losses.double() * counted).sum(), num_bytes.sum().double(),
                                 (used * counted).sum().double(), counted.sum().double()])
    except Exception as e:  # noqa: BLE001 - reported below on every rank, so no rank waits for this one
        error = e
    (nats, nbytes, used_steps, tokens), (failed,) = reduce_with_flags(sums, [error is not None], to_host=True)
    raise_if_any_rank_failed(error, "evaluation with halting", failed)
    return nats / (math.log(2) * nbytes), used_steps / tokens


def format_halting(split, halting, bpb, mean_steps, n_sup):
    return f"{split} halting {halting}: bpb {bpb:.4f} at mean {mean_steps:.2f} of {n_sup} supervision steps"
