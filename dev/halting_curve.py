"""
Is per-token halting worth it? Validation bpb against mean supervision steps, for each halting rule over a sweep of
thresholds, next to running a fixed n_sup = 1..N for every token.

python -m dev.halting_curve --model_tag=d4 --split_tokens=262144 --out=dev/results/halting_d4

Writes OUT.md (the table: rule, threshold, mean steps, bpb) and OUT.png (bpb against mean steps; the fixed-depth
curve is the line halting must lie below to pay). Mean steps count exactly the steps decoding with halting runs,
averaged over the tokens bpb counts (loss_eval.evaluate_bpb_halting). Rule head runs only for a model with a
halting head. Each point also gives the bpb of the same rule with every token run to the end for later tokens to
read (hold_keys=False): the difference is what reading a halted token's keys from the step it halted at costs.
"""

import os

from nanochat import checkpoint as ckpt
from nanochat.cli import ArgumentParser, Exit, missing_package
from nanochat.common import autocast_for, autodetect_device_type, compute_init, default_dtype
from nanochat.eval.loss_eval import evaluate_bpb, evaluate_bpb_halting
from nanochat.model.halting import Halting

THRESHOLDS = {  # from 'halts almost nothing' to 'halts almost everything after step 1' on the CPU-scale models
    "kl": [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1],
    "rms": [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4],
    "head": [0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9],
}


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m dev.halting_curve")
    ckpt.checkpoint_flags(p)
    p.add_argument("--device_batch_size", type=int, default=8)
    p.add_argument("--max_seq_len", type=int, default=None, help="default: the model's sequence_len")
    p.add_argument("--split_tokens", type=int, default=262144, help="validation tokens per point")
    p.add_argument("--rules", default="kl,rms,head", help="comma-separated; head is skipped without a halting head")
    p.add_argument("--out", default="dev/results/halting_curve", help="writes OUT.md and OUT.png")
    p.add_argument("--device_type", default="")
    args = p.parse_args(argv)
    for name in ("device_batch_size", "split_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be >= 1")
    args.rules = [r for r in args.rules.split(",") if r]
    unknown = [r for r in args.rules if r not in THRESHOLDS]
    if unknown or not args.rules:
        p.error(f"--rules={','.join(args.rules)}: choose from {','.join(THRESHOLDS)}")
    return args


def measure(model, loader, steps, token_bytes, rules, autocast):
    """Rows (label, threshold or None, mean steps, bpb, bpb with every step's keys or None): fixed n_sup = 1..N,
    then each rule's thresholds."""
    n = model.config.n_sup_inference
    fixed, _ = evaluate_bpb(model, loader, steps, token_bytes, n_sup=n, autocast=autocast)
    rows = [("fixed", None, float(s), bpb, None) for s, bpb in enumerate(fixed, start=1)]
    for rule in rules:
        for threshold in THRESHOLDS[rule]:
            halting = Halting(rule, threshold)
            bpb, mean = evaluate_bpb_halting(model, loader, steps, token_bytes, halting, autocast=autocast)
            unheld, _ = evaluate_bpb_halting(model, loader, steps, token_bytes, halting, autocast=autocast,
                                             hold_keys=False)
            rows.append((rule, threshold, mean, bpb, unheld))
            print(f"{rule}:{threshold:g}  mean steps {mean:.3f}  bpb {bpb:.4f}  (every step's keys: {unheld:.4f})",
                  flush=True)
    return rows


def table(rows, title):
    lines = [f"## {title}", "", "| rule | threshold | mean steps | val bpb | val bpb, every step's keys |",
             "|---|---|---|---|---|"]
    lines += [f"| {label} | {'' if t is None else f'{t:g}'} | {mean:.3f} | {bpb:.4f} | "
              f"{'' if unheld is None else f'{unheld:.4f}'} |" for label, t, mean, bpb, unheld in rows]
    return "\n".join(lines) + "\n"


def plot(rows, title, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise Exit(missing_package(e, "halting_curve"))
    fig, ax = plt.subplots(figsize=(7, 5))
    for label in dict.fromkeys(r[0] for r in rows):
        points = sorted((mean, bpb) for lab, _, mean, bpb, _ in rows if lab == label)
        ax.plot(*zip(*points), "k-o" if label == "fixed" else "--.", label="fixed n_sup" if label == "fixed" else label)
    ax.set_xlabel("mean supervision steps per token")
    ax.set_ylabel("validation bpb")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    device_type = args.device_type or autodetect_device_type()
    _, rank, _, world_size, device = compute_init(device_type)
    from nanochat.data.dataloader import evaluation_batches, evaluation_size
    from nanochat.data.tokenizer import get_token_bytes
    try:
        model, tokenizer, meta, model_tag, _ = ckpt.open_checkpoint(args.model_tag, args.step, device)
    except ValueError as e:
        raise Exit(f"halting_curve: {e}")
    rules = [r for r in args.rules if r != "head" or model.config.halt_head]
    T = min(args.max_seq_len or model.config.sequence_len, model.config.sequence_len)
    n_rows, steps = evaluation_size(args.split_tokens, args.device_batch_size, T, world_size)
    loader = lambda: evaluation_batches(tokenizer, args.device_batch_size, T, "val", args.split_tokens, rank,
                                        world_size, device)  # the same rows on any number of processes
    autocast = autocast_for(device_type, default_dtype(device_type))
    rows = measure(model, loader, steps, get_token_bytes(device=device), rules, autocast)
    title = (f"{model_tag} step {meta['step']}: val bpb against mean steps, {n_rows * T:,} "
             f"tokens, n_sup_inference={model.config.n_sup_inference}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(table(rows, title))
    plot(rows, title, args.out + ".png")
    print(f"table: {args.out}.md\nplot: {args.out}.png")
    return rows


if __name__ == "__main__":
    main()
