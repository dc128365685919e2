"""
Do later steps hurt if each token keeps the answer of the step where it halted? Validation bpb by inference budget
(1 .. --n_sup supervision steps), read two ways from one pass over the data:

- fixed: every token takes the last step's answer (what base_loss prints per step);
- halting readout, rule:threshold: a token keeps the answer of the first step whose halting score falls below the
  threshold (halting.HALTING_RULES: kl, rms, head), or of the budget's last step. Exactly what
  loss_eval.evaluate_bpb_halting(..., hold_keys=False) computes at each budget, for all budgets and thresholds at once.

Every threshold of a sweep is reported, on validation and (the best budget, in brackets) on the train split; the one
judged is fixed in advance: the product's own halting (PRODUCT_HALTING, the server's n_sup "auto"), so the readout
is not tuned on the numbers it is judged by. Issue 57 item 4's bar, per row: bpb at 2N and 4N at most bpb at N +
0.002, and the best budget >= N (ties go to the larger budget: a readout that stops changing holds).

python -m dev.readout --model_tag=d4 --n_sup=12 --split_tokens=32768 --out dev/results/readout.jsonl
"""

import json
import math

import torch
import torch.nn.functional as F

from nanochat import checkpoint as ckpt
from nanochat.cli import ArgumentParser, Exit
from nanochat.common import compute_init
from nanochat.model.halting import HALTING_RULES, Draft

PRODUCT_HALTING = "kl:0.0005"  # what the server's n_sup "auto" runs (nanochat/serve/api.py AUTO_HALTING)
# halting_curve's sweeps, extended upward to thresholds that halt nearly every token after step 1 on CPU text models
THRESHOLDS = {
    "kl": [0.0001, 0.0003, 0.0005, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0],
    "rms": [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8],
    "head": [0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9],
}


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m dev.readout")
    ckpt.checkpoint_flags(p)
    p.add_argument("--n_sup", type=int, default=None, help="the largest budget (default: 4 x n_sup_train)")
    p.add_argument("--device_batch_size", type=int, default=8)
    p.add_argument("--max_seq_len", type=int, default=None, help="default: the model's sequence_len")
    p.add_argument("--split_tokens", type=int, default=32768, help="tokens per split (train, val)")
    p.add_argument("--rules", default="kl,rms", help="comma-separated halting rules (head needs a halting head)")
    p.add_argument("--out", default=None, help="append one JSON line per checkpoint here")
    return p.parse_args(argv)


@torch.no_grad()
def step_losses_and_scores(model, batches, steps, token_bytes, n_sup, rules):
    """(losses (n_sup, tokens) in nats, scores {rule: (n_sup, tokens)}, bytes (tokens,)) over the counted tokens."""
    losses, scores, nbytes = [], {r: [] for r in rules}, []
    for _ in range(steps):
        x, y = next(batches)
        counted = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0) > 0
        embedding = model.embed(x)
        previous, rows, row_scores = Draft(model, embedding), [], {r: [] for r in rules}
        for state, _ in model.refine(x, n_sup, x=embedding):
            current = Draft(model, state)
            rows.append(F.cross_entropy(current.logits.flatten(0, 1), y.flatten(), ignore_index=-1,
                                        reduction="none").view(y.shape)[counted])
            for r in rules:
                row_scores[r].append(HALTING_RULES[r](model, previous, current)[counted])
            previous = current
        losses.append(torch.stack(rows))
        for r in rules:
            scores[r].append(torch.stack(row_scores[r]))
        nbytes.append(token_bytes[y.clamp(min=0)][counted])
    return (torch.cat(losses, 1).double(), {r: torch.cat(v, 1).float() for r, v in scores.items()},
            torch.cat(nbytes).double())


def bpb_by_budget(losses, nbytes, halt_step=None):
    """[bpb at budget 1..n]: each token's loss at min(its halt step, budget) (0-based halt step; None: never)."""
    n = losses.size(0)
    out = []
    for budget in range(1, n + 1):
        step = torch.full_like(nbytes, budget - 1, dtype=torch.long) if halt_step is None else \
            halt_step.clamp(max=budget - 1)
        out.append((losses.gather(0, step[None]).sum() / (math.log(2) * nbytes.sum())).item())
    return out


def halt_steps(score, threshold):
    """0-based step at which each token halts: the first whose score < threshold (n_sup if none)."""
    below = score < threshold
    never = torch.full_like(below[0], score.size(0), dtype=torch.long)
    return torch.where(below.any(0), below.float().argmax(0), never)  # argmax: the first True


def mean_steps(halt_step, budget):
    return (halt_step.clamp(max=budget - 1) + 1).double().mean().item()


def verdict(bpb, n):
    """(2N - N, 4N - N, best budget 1-based) of a bpb-by-budget list over 4N budgets."""
    return bpb[2 * n - 1] - bpb[n - 1], bpb[-1] - bpb[n - 1], min(range(len(bpb)), key=lambda i: (bpb[i], -i)) + 1


def measure(model, tokenizer, device, args):
    """{n, n_sup, fixed: {split: [bpb by budget]}, readouts: [{rule, threshold, train, val, mean steps at 4N}]}."""
    from nanochat.data.dataloader import evaluation_batches, evaluation_size
    from nanochat.data.tokenizer import get_token_bytes
    n = model.config.n_sup_train
    n_sup = args.n_sup or 4 * n
    T = min(args.max_seq_len or model.config.sequence_len, model.config.sequence_len)
    token_bytes = get_token_bytes(device=device)
    rules = [r for r in args.rules.split(",") if r and (r != "head" or model.config.halt_head)]
    splits = {}
    for split in ("train", "val"):
        _, steps = evaluation_size(args.split_tokens, args.device_batch_size, T, 1)
        batches = evaluation_batches(tokenizer, args.device_batch_size, T, split, args.split_tokens, 0, 1, device)
        splits[split] = step_losses_and_scores(model, batches, steps, token_bytes, n_sup, rules)
    result = {"n": n, "n_sup": n_sup, "fixed": {s: bpb_by_budget(v[0], v[2]) for s, v in splits.items()},
              "readouts": []}
    for rule in rules:
        for threshold in THRESHOLDS[rule]:
            row = {"rule": rule, "threshold": threshold}
            for split, (losses, scores, nbytes) in splits.items():
                halted = halt_steps(scores[rule], threshold)
                row[split] = bpb_by_budget(losses, nbytes, halted)
                row[f"{split}_mean_steps_at_4N"] = mean_steps(halted, n_sup)
            result["readouts"].append(row)
    return result


def report(tag, result):
    n = result["n"]
    lines = [f"{tag}: N = {n}, budgets 1..{result['n_sup']}, validation bpb (train split's best budget in brackets)"]
    rows = [("fixed", result["fixed"]["val"], result["fixed"]["train"], "")]
    rows += [(f"{r['rule']}:{r['threshold']:g}", r["val"], r["train"], f" mean {r['val_mean_steps_at_4N']:.2f} steps"
              + ("  <- the product's halting" if f"{r['rule']}:{r['threshold']:g}" == PRODUCT_HALTING else ""))
             for r in result["readouts"]]
    for name, bpb, train, extra in rows:
        d2, d4, best = verdict(bpb, n)
        lines.append(f"  {name:>12}  1 {bpb[0]:.4f}  N {bpb[n - 1]:.4f}  2N {bpb[2 * n - 1]:.4f}  4N {bpb[-1]:.4f}  "
                     f"2N-N {d2:+.4f}  4N-N {d4:+.4f}  best {best} [{verdict(train, n)[2]}]{extra}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    _, _, _, _, device = compute_init("cpu")
    try:
        model, tokenizer, meta, tag, _ = ckpt.open_checkpoint(args.model_tag, args.step, device)
    except ValueError as e:
        raise Exit(f"readout: {e}")
    model.eval()
    result = measure(model, tokenizer, device, args)
    print(report(tag, result), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"tag": tag, "step": meta["step"], **result}) + "\n")
    return result


if __name__ == "__main__":
    main()
