"""Accuracy by hops at every supervision step on the hops corpus (nanochat.data.synthetic): does the recursion add
depth?

Each answer character is predicted, teacher-forced, at the position before it: exact match is the argmax there being
the answer's token, and the answer tokens' bits per byte per step are -log2 p(answer) summed over their bytes.
Everything is read from the documents' text (hop counts, symbols), so any hops corpus and any tokenizer works, as
long as each answer character is one token of its own.

    result = evaluate_hops(model, tokenizer, documents, n_steps=8)
    print(format_hops(result))

The model needs GPT's evaluation interface: config.vocab_size and config.sequence_len, refine(idx, n) yielding
(y, z) after each supervision step, apply_coda(y) and head(y) -> logits.
"""

import math
import textwrap

import torch

from nanochat.collectives import raise_if_any_rank_failed, reduce_with_flags
from nanochat.common import progress_bar
from nanochat.data.synthetic import HopsEvalError, encode_hops, table_size


@torch.no_grad()
def evaluate_hops(model, tokenizer, documents, n_steps, batch_size=32, device="cpu", autocast=None, rank=0,
                  world_size=1):
    """Accuracy and answer bits per byte by hop count for supervision steps 1..n_steps, as a JSON-ready dict:
    hops [1..H], answers [count per hop], accuracy[step][hop], answer_bpb[step], answer_bpb_by_hops[step][hop],
    chance (1/symbols, over all documents), documents. Index hop lists with hops.index(h).

    Every rank encodes (and so checks) all documents, then runs documents[rank::world_size]; the sums are reduced over
    ranks, so every rank returns the same numbers. A model failure on any rank raises RankFailure on every rank."""
    documents = list(documents)
    if not documents:
        raise HopsEvalError("no documents to evaluate")
    cache = {}
    encoded = [encode_hops(tokenizer, text, cache) for text in documents]
    longest = max(len(ids) for ids, _ in encoded) - 1  # inputs: every token but the last
    if longest > model.config.sequence_len:
        raise HopsEvalError(f"the documents are up to {longest} tokens, longer than the model's "
                            f"{model.config.sequence_len}-token context; build the corpus with fewer --hops_queries "
                            "or train with a longer --max_seq_len")
    max_hops = max(h for _, answers in encoded for _, h, _, _ in answers)
    # per step: correct and nats by hop; then answers and bytes by hop
    sums = torch.zeros(2 * n_steps + 2, max_hops + 1, dtype=torch.float64, device=device)
    mine = encoded[rank::world_size]
    error = None
    try:
        for start in progress_bar(range(0, len(mine), batch_size), desc="hops evaluation", unit="batches"):
            evaluate_batch(model, mine[start:start + batch_size], n_steps, sums, device, autocast)
    except Exception as e:  # noqa: BLE001 - reported below on every rank, so no rank waits for this one
        error = e
    flat, (failed,) = reduce_with_flags(sums.flatten(), [error is not None])
    raise_if_any_rank_failed(error, "hops evaluation", failed)
    sums = flat.view_as(sums).cpu()
    correct, nats, count, nbytes = sums[:n_steps], sums[n_steps:2 * n_steps], sums[-2], sums[-1]
    hops = [h for h in range(1, max_hops + 1) if count[h] > 0]
    return {
        "hops": hops,
        "answers": [int(count[h]) for h in hops],
        "accuracy": [[(correct[s, h] / count[h]).item() for h in hops] for s in range(n_steps)],
        "answer_bpb": [(nats[s].sum() / (math.log(2) * nbytes.sum())).item() for s in range(n_steps)],
        "answer_bpb_by_hops": [[(nats[s, h] / (math.log(2) * nbytes[h])).item() for h in hops]
                               for s in range(n_steps)],
        "chance": len(documents) / sum(table_size(text) for text in documents),  # 1/n for one spec
        "documents": len(documents),
    }


def padded_inputs(batch, device="cpu"):
    """The inputs (every token but the last) of encoded documents [(ids, answers)], one row each, padded after each
    row's end: causal attention keeps the padding out of every position that is read."""
    length = max(len(ids) for ids, _ in batch) - 1
    return torch.tensor([ids[:-1] + [ids[0]] * (length - len(ids) + 1) for ids, _ in batch], device=device)


def evaluate_batch(model, batch, n_steps, sums, device, autocast):
    """Add one batch's correct answers and nats (per step, by hop) and answers and bytes (by hop) into sums."""
    idx = padded_inputs(batch, device)
    rows, pos, hops, want, nbytes = (torch.tensor(v, device=device) for v in zip(
        *[(r, i - 1, h, t, b) for r, (_, answers) in enumerate(batch) for i, h, t, b in answers]))
    sums[-2].index_add_(0, hops, torch.ones_like(hops, dtype=sums.dtype))
    sums[-1].index_add_(0, hops, nbytes.to(sums.dtype))
    with autocast or torch.autocast(idx.device.type, enabled=False):
        for s, (y, _) in enumerate(model.refine(idx, n_steps)):
            # the head on the answer positions only: a whole batch's logits can be gigabytes at a BPE vocabulary
            logits = model.head(model.apply_coda(y)[rows, pos]).float()
            log_p = torch.log_softmax(logits, dim=-1).gather(1, want[:, None]).squeeze(1)
            sums[s].index_add_(0, hops, (logits.argmax(-1) == want).to(sums.dtype))
            sums[n_steps + s].index_add_(0, hops, -log_p.double())


def format_hops(result):
    """The accuracy table, one row per supervision step and one column per hop count, then the answers' bpb."""
    hops = result["hops"]
    lines = [f"accuracy by hops (rows: supervision step; chance {result['chance']:.3f}; "
             f"{sum(result['answers']):,} answers in {result['documents']:,} documents)",
             "step " + " ".join(f"{f'{h} hops':>8s}" for h in hops) + "  answer bpb"]
    for s, (row, bpb) in enumerate(zip(result["accuracy"], result["answer_bpb"]), start=1):
        lines.append(f"{s:4d} " + " ".join(f"{v:8.3f}" for v in row) + f"  {bpb:10.4f}")
    return "\n".join(lines)


def hops_figure(title, lines, chance, trained_steps=None, warnings=()):
    """The figure of save_plot: accuracy vs supervision step, one line per (label, accuracies); a dashed line at the
    trained step count N (what lies right of it the model never trained), and each warning printed on the plot."""
    import matplotlib  # lazy: the optional matplotlib (the 'plot' extra), ~0.9 s, for the plot only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use, which must precede it
    fig, ax = plt.subplots(figsize=(6, 4 + 0.5 * len(warnings)))
    longest = max(len(accuracies) for _, accuracies in lines)
    for label, accuracies in lines:
        if len(accuracies) == 1 and longest > 1:  # a one-step model (the plain block), level across the others' steps
            ax.plot([1, longest], accuracies * 2, linestyle="--", label=label)
        else:
            ax.plot(range(1, len(accuracies) + 1), accuracies, marker="o", label=label)
    ax.axhline(chance, color="gray", linestyle=":", label="chance")
    if trained_steps:
        ax.axvline(trained_steps, color="gray", linestyle="--", linewidth=0.8, label=f"trained steps N={trained_steps}")
    if longest == 1:  # one step only: matplotlib would zoom the x-axis to 0.96-1.04 around the lone points
        ax.set_xlim(0.5, 1.5)
        ax.set_xticks([1])
    ax.set(xlabel="supervision step", ylabel="exact-match accuracy", ylim=(0, 1.02), title=title)
    ax.legend(fontsize=8)
    for i, warning in enumerate(warnings):
        fig.text(0.01, 0.01 + 0.06 * i, textwrap.fill(warning, 110), color="red", fontsize=6, va="bottom")
    fig.tight_layout(rect=(0, 0.08 * len(warnings), 1, 1))
    return fig


def save_plot(path, title, lines, chance, trained_steps=None, warnings=()):
    """Accuracy vs supervision step (hops_figure), saved to path (needs matplotlib: the 'plot' extra)."""
    import matplotlib.pyplot as plt  # lazy: hops_figure has chosen the backend
    fig = hops_figure(title, lines, chance, trained_steps, warnings)
    fig.savefig(path)
    plt.close(fig)


def plot_hops(result, path, title=""):
    """One model's accuracy vs supervision step, one line per hop count."""
    lines = [(f"{h} hop{'s' * (h > 1)}", [row[j] for row in result["accuracy"]]) for j, h in enumerate(result["hops"])]
    save_plot(path, title, lines, result["chance"], result.get("n_sup_train"))


def plot_models(results, path, title="", warnings=()):
    """The longest hop count's accuracy vs supervision step, one line per model ({label: result}): a recursion that
    uses its depth stands above the plain model of its parameters (scored at its one step, drawn level). The trained
    step count of the deepest-trained model is marked, and each warning is printed on the plot."""
    lines = [(f"{label}, {r['hops'][-1]} hops", [row[-1] for row in r["accuracy"]]) for label, r in results.items()]
    trained = max((r.get("n_sup_train") or 0 for r in results.values()), default=0)
    save_plot(path, title, lines, min(r["chance"] for r in results.values()), trained if trained > 1 else None,
              warnings)

