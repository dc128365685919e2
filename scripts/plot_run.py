"""
Plot a run: per-supervision-step training losses, per-step validation bpb and refinement % over training.

    python -m scripts.plot_run d4                 # a model tag under $NANOCHAT_BASE_DIR/base_checkpoints
    python -m scripts.plot_run path/to/run_dir    # any directory holding metrics.jsonl
"""

import argparse
import json
import os
import sys

from nanochat import checkpoint_manager as ckpt


def read_metrics(run_dir):
    """The last record per (kind, step): a resumed run may have logged a step twice."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"plot_run: no metrics.jsonl in {run_dir}; is this a run directory or model tag?")
    records = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            records[(r["kind"], r["step"])] = r
    train = sorted((r for r in records.values() if r["kind"] == "train"), key=lambda r: r["step"])
    evals = sorted((r for r in records.values() if r["kind"] == "eval"), key=lambda r: r["step"])
    return train, evals


def plot(run_dir, out_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_run: matplotlib is not installed; pip install -e '.[plot]' (or pip install matplotlib)")
    train, evals = read_metrics(run_dir)
    fig, (ax_loss, ax_bpb, ax_ref) = plt.subplots(1, 3, figsize=(16, 4.5))
    steps = [r["step"] for r in train]
    for s in range(len(train[0]["step_losses"]) if train else 0):
        ax_loss.plot(steps, [r["step_losses"][s] for r in train], label=f"step_{s}", lw=1)
    ax_loss.set(title="training loss per supervision step", xlabel="optimizer step", ylabel="loss (nats)")
    eval_steps = [r["step"] for r in evals]
    for s in range(len(evals[0]["val_bpb"]) if evals else 0):
        ax_bpb.plot(eval_steps, [r["val_bpb"][s] for r in evals], marker="o", label=f"step_{s}")
    ax_bpb.set(title="validation bits per byte per supervision step", xlabel="optimizer step", ylabel="bpb")
    ax_ref.plot(steps, [100 * r["refinement"] for r in train], label="train (batch)", lw=1)
    ax_ref.plot(eval_steps, [100 * r["val_refinement"] for r in evals], marker="o", label="validation")
    ax_ref.set(title="refinement % (step_0 -> last step)", xlabel="optimizer step", ylabel="%")
    for ax in (ax_loss, ax_bpb, ax_ref):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    tmp = out_path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out_path)
    return out_path


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.plot_run")
    p.add_argument("run", help="a model tag or a directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: <run dir>/training.png)")
    args = p.parse_args(argv)
    run_dir = args.run if os.path.isdir(args.run) else ckpt.model_dir(args.run)
    print(f"plot: {plot(run_dir, args.out or os.path.join(run_dir, 'training.png'))}")


if __name__ == "__main__":
    sys.exit(main())
