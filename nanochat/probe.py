"""
The depth probe (base_train --probe=hops): does this run's recursion use its depth? A small share of the training
rows are hops documents (nanochat.synthetic: chained lookups of a known number of hops), and every evaluation reports
accuracy by hop count at every supervision step on fresh ones (nanochat.hops_eval), beside the text's bpb.

The rows are replaced in place, a pure function of (seed, step, micro-step, rank): the text loaders advance exactly
as without the probe, so a resumed run mixes the same rows at the same steps, and every rank of a step mixes the same
number. Over the run, `share` of the training rows are the probe's (a step gets floor or ceil of share x batch).
"""

import math
import random
from dataclasses import dataclass

import torch

from nanochat.hops_eval import encode_hops
from nanochat.synthetic import HopsSpec, hops_document, iter_hops_documents

PROBES = ("none", "hops")
EVAL_SEED = 1_000_003  # the evaluation's documents: never drawn for training (a separate stream)


@dataclass(frozen=True)
class Probe:
    share: float  # of the training rows
    seed: int
    eval_docs: int
    spec: HopsSpec = HopsSpec(n_symbols=8, max_hops=4, n_queries=16)  # the 8-cycles of issue 36; ~110 characters

    def rows_at(self, step, micro, micro_steps, batch):
        """How many of this micro-batch's rows are the probe's: the running total floor(share x rows so far)."""
        k = step * micro_steps + micro  # the micro-batches before this one (step counts from 0, as optimizer_step)
        return math.floor((k + 1) * self.share * batch) - math.floor(k * self.share * batch)

    def token_rows(self, tokenizer, count, length, step, micro, rank):
        """count rows of length tokens: hops documents, each <|bos|>-led as the loader packs text, back to back."""
        rng = random.Random(f"probe:{self.seed}:{step}:{micro}:{rank}")
        stream, cache = [], {}
        while len(stream) < count * length:
            stream += encode_hops(tokenizer, hops_document(rng, self.spec), cache)[0]
        return torch.tensor(stream[:count * length]).view(count, length)

    def mix(self, x, y, tokenizer, step, micro, micro_steps, rank):
        """(x, y) with the last rows_at(...) rows replaced by hops rows (inputs and next-token targets)."""
        n = self.rows_at(step, micro, micro_steps, x.size(0))
        if n == 0:
            return x, y
        rows = self.token_rows(tokenizer, n, x.size(1) + 1, step, micro, rank).to(x.device)
        x, y = x.clone(), y.clone()
        x[-n:], y[-n:] = rows[:, :-1], rows[:, 1:]
        return x, y

    def eval_documents(self):
        """The evaluation's documents: the same at every evaluation and on every rank."""
        return list(iter_hops_documents(EVAL_SEED + self.seed, self.eval_docs, self.spec))


def build(name, share, seed, eval_docs):
    """The run's probe, or None (--probe=none)."""
    if name not in PROBES:
        raise ValueError(f"--probe={name!r} is unknown; choose one of {', '.join(PROBES)}")
    if name == "none":
        return None
    if not 0 < share < 1:
        raise ValueError(f"--probe_share={share}: must be between 0 and 1 (the share of training rows)")
    return Probe(share, seed, eval_docs)


def format_probe(result, trained_steps):
    """One line: accuracy on the longest hop count at each supervision step, and every hop count at the last."""
    hops, acc = result["hops"], result["accuracy"]
    longest = " ".join(f"{row[-1]:.2f}" for row in acc)
    last = " ".join(f"{h}:{v:.2f}" for h, v in zip(hops, acc[trained_steps - 1]))
    return (f"probe: {hops[-1]} hops by step {longest} | at step {trained_steps}, by hops {last} "
            f"(chance {result['chance']:.2f})")
