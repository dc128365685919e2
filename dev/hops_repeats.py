"""
Does a model answer a hops query by composing lookups, or by copying the answer of the same query asked earlier in
the document (on the pairs-and-answers corpus 40% of the queries repeat one)? Accuracy by hop count at every
supervision step, split into first-time queries and repeats, for a base_train checkpoint on the hops corpus's
validation documents (issue 36).

    NANOCHAT_BASE_DIR=... python -m dev.hops_repeats --model_tag hops_plain --n_sup 1
"""

import argparse
import itertools

import torch

from nanochat import checkpoint as ckpt
from nanochat.data.dataset import iter_documents
from nanochat.data.synthetic import encode_hops, hops_answers
from nanochat.eval.hops_eval import padded_inputs


def first_times(text):
    """Per answer of a document: True when its query (the text from the last space to the answer) is new there."""
    seen, out = set(), []
    for a in hops_answers(text):
        query = text[text.rfind(" ", 0, a.position) + 1:a.position]
        out.append(query not in seen)
        seen.add(query)
    return out


@torch.no_grad()
def split_accuracy(model, tokenizer, documents, n_steps, batch=50):
    """{(step, hops, first time): [right, count]}"""
    stats, cache = {}, {}
    for b in range(0, len(documents), batch):
        texts = documents[b:b + batch]
        encoded = [encode_hops(tokenizer, t, cache) for t in texts]
        idx = padded_inputs(encoded)
        for s, (y, _) in enumerate(model.refine(idx, n_steps), start=1):
            logits = model.head(model.apply_coda(y))
            for r, ((_, answers), text) in enumerate(zip(encoded, texts)):
                for (i, h, want, _), first in zip(answers, first_times(text)):
                    cell = stats.setdefault((s, h, first), [0, 0])
                    cell[0] += int(logits[r, i - 1].argmax() == want)
                    cell[1] += 1
    return stats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ckpt.checkpoint_flags(ap)
    ap.add_argument("--n_sup", type=int, default=None, help="supervision steps to evaluate (default: 2x trained)")
    ap.add_argument("--docs", type=int, default=1000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = ckpt.open_checkpoint(args.model_tag, args.step, "cpu")[:2]
    n_steps = args.n_sup or 2 * model.config.n_sup_inference
    documents = list(itertools.islice(iter_documents("val"), args.docs))
    stats = split_accuracy(model, tokenizer, documents, n_steps)
    hops = sorted({h for _, h, _ in stats})
    for first in (True, False):
        counts = [stats[(1, h, first)][1] for h in hops]
        print(f"{args.model_tag}: {'first-time queries' if first else 'repeats of an earlier query'} "
              f"(answers by hops {counts}); accuracy by hops at each step")
        for s in range(1, n_steps + 1):
            print(f"  step {s}: " + " ".join(f"{stats[(s, h, first)][0] / stats[(s, h, first)][1]:.3f}" for h in hops))


if __name__ == "__main__":
    main()
