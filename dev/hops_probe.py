"""
What the recursion's states carry on the pairs-and-answers rows (issue 36): a linear probe, fitted on half of the
held-out rows' EQ positions and scored on the other half, reads the symbol pi^j(x) that is j hops from the query's
symbol out of y and out of z at every supervision step. A recursion that uses its depth should hold later hops at
later steps; a flat one holds the same thing at every step.

python -m dev.hops_probe /tmp/hops36_models/old_default_seed42.pt --hops 4
"""

import argparse
import random

import torch

from dev.hops import SYMBOL, answers_row
from nanochat.data.synthetic import HopsSpec
from nanochat.model.gpt import GPT, GPTConfig


def walk(ids, pos, j):
    """pi^j(x) of the query at each EQ position, from the row's own table tokens."""
    table = {}
    for t in ids[1:9]:
        a, b = divmod(t - 21, 8)
        table[a] = b
    out = []
    for p in pos:
        y = ids[p - 2] - SYMBOL
        for _ in range(j):
            y = table[y]
        out.append(y)
    return out


def probe_accuracy(features, labels, classes=8, iters=300):
    """Fit softmax regression on the first half, return accuracy on the second half."""
    n = features.size(0) // 2
    mean, std = features[:n].mean(0), features[:n].std(0) + 1e-6
    f = (features - mean) / std
    w = torch.zeros(f.size(1), classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(f[:n] @ w + b, labels[:n]) + 1e-3 * w.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return ((f[n:] @ w + b).argmax(-1) == labels[n:]).float().mean().item()


@torch.no_grad()
def states(model, rows, n_steps):
    """[(y, z) at the EQ positions, (rows * queries, C) each] for steps 1..n_steps."""
    idx = torch.tensor([r[0] for r in rows])
    pos = torch.tensor([r[1] for r in rows])
    gather = lambda t: t.gather(1, pos[..., None].expand(-1, -1, t.size(-1))).flatten(0, 1)
    out = []
    for y, z in model.refine(idx, n_steps):
        out.append((gather(y), gather(z) if z is not None else None))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--hops", type=int, default=4, help="every query of the probed rows has this many hops")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--steps", type=int, default=0, help="supervision steps (0: 2 * n_sup_train)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    saved = torch.load(args.model)
    model = GPT(GPTConfig.from_dict(saved["config"]))
    model.load_state_dict(saved["state_dict"])
    model.eval()
    spec = HopsSpec(n_symbols=8, max_hops=4, n_queries=8)
    rng = random.Random(20_000)
    rows = [answers_row(rng, spec, args.hops) for _ in range(args.rows)]
    n_steps = args.steps or 2 * model.config.n_sup_train
    per_step = states(model, rows, n_steps)
    labels = {j: torch.tensor([v for r in rows for v in walk(r[0], r[1], j)]) for j in range(args.hops + 1)}
    head = [(model.head(y).argmax(-1) - SYMBOL == labels[args.hops]).float().mean().item() for y, _ in per_step]
    print(f"{args.model}: {args.hops}-hop queries; probe accuracy of pi^j(x) on held-out rows (chance 0.125)")
    print("| state | step | head | " + " | ".join(f"j={j}" for j in range(args.hops + 1)) + " |")
    print("|---|---|---|" + "---|" * (args.hops + 1))
    for s, (y, z) in enumerate(per_step):
        for name, t in (("y", y), ("z", z)):
            if t is None:
                continue
            accs = [probe_accuracy(t.float(), labels[j]) for j in range(args.hops + 1)]
            print(f"| {name} | {s + 1} | {head[s]:.2f} | " + " | ".join(f"{a:.2f}" for a in accs) + " |", flush=True)


if __name__ == "__main__":
    main()
