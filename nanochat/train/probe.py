"""
The depth probe (base_train --probe=hops): does this run's recursion use its depth? A small share of the training
tokens are hops documents (nanochat.data.synthetic: chained lookups of a known number of hops), and every evaluation
reports accuracy by hop count at every supervision step on fresh ones (nanochat.eval.hops_eval), beside the text's bpb.

Each probe document is written over the start of a text row, the row's own text going on after it, so the document
starts its row as in the evaluation. With anything before it in the row (other documents, or even unscored filler) a
small recursion stayed on the loss plateau where one document a row left it (issue 36, dev/LOG.md). The rows are
written in place, a pure function of (seed, step, micro-step, rank): the text loaders advance exactly as without the
probe, so a resumed run mixes the same rows at the same steps, and every rank of a step mixes the same number. Over
the run, `share` of the training tokens are the probe's (a micro-batch gets floor or ceil of its share of rows, at
most all of them).
"""

import functools
import math
import random
from dataclasses import dataclass

import torch

from nanochat.data.dataloader import UNSCORED
from nanochat.data.synthetic import HopsSpec, encode_hops, hops_document, iter_hops_documents

PROBES = ("none", "hops")
EVAL_SEED = 1_000_003  # the evaluation's documents: never drawn for training (a separate stream)


@functools.cache  # mix asks at every micro-step; the answer depends on these three alone
def document_tokens(tokenizer, spec, seed):
    return len(encode_hops(tokenizer, hops_document(random.Random(f"probe-length:{seed}"), spec))[0])


@dataclass(frozen=True)
class Probe:
    share: float  # of the training tokens
    seed: int
    eval_docs: int
    spec: HopsSpec = HopsSpec(n_symbols=8, max_hops=4, n_queries=16)  # the 8-cycles of issue 36; ~110 characters

    def document_tokens(self, tokenizer):
        """The tokens of one probe document, <|bos|> included (every document of the spec has one length in
        characters; a BPE tokenizer's counts differ by a few)."""
        return document_tokens(tokenizer, self.spec, self.seed)

    def rows_at(self, step, micro, micro_steps, batch, row_tokens, document_tokens):
        """How many of this micro-batch's rows start with a probe document: the running total of share x tokens
        in documents, one document a row (so at most every row)."""
        per_micro = min(batch, self.share * batch * row_tokens / document_tokens)
        k = step * micro_steps + micro  # the micro-batches before this one (step counts from 0, as optimizer_step)
        return math.floor((k + 1) * per_micro) - math.floor(k * per_micro)

    def mix(self, x, y, tokenizer, step, micro, micro_steps, rank):
        """(x, y) with a hops document (inputs and next-token targets) written over the start of each of the last
        rows_at(...) rows; the rest of each row keeps its text."""
        T = x.size(1)
        n = self.rows_at(step, micro, micro_steps, x.size(0), T + 1, self.document_tokens(tokenizer))
        if n == 0:
            return x, y
        rng = random.Random(f"probe:{self.seed}:{step}:{micro}:{rank}")
        x, y, cache = x.clone(), y.clone(), {}
        for row in range(x.size(0) - n, x.size(0)):
            ids = torch.tensor(encode_hops(tokenizer, hops_document(rng, self.spec), cache)[0][:T + 1])
            covered = min(len(ids), T)
            x[row, :covered] = ids[:covered]
            y[row, :len(ids) - 1] = ids[1:]
            if len(ids) <= T:  # the document's last token predicts nothing: the row's text resumes after it
                y[row, len(ids) - 1] = UNSCORED
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
        raise ValueError(f"--probe_share={share}: must be between 0 and 1 (the share of training tokens)")
    return Probe(share, seed, eval_docs)


def format_probe(result, trained_steps):
    """One line: accuracy on the longest hop count at each supervision step, and every hop count at the last."""
    hops, acc = result["hops"], result["accuracy"]
    longest = " ".join(f"{row[-1]:.2f}" for row in acc)
    last = " ".join(f"{h}:{v:.2f}" for h, v in zip(hops, acc[trained_steps - 1]))
    return (f"probe: {hops[-1]} hops by step {longest} | at step {trained_steps}, by hops {last} "
            f"(chance {result['chance']:.2f})")
