"""
Plot a run so you can see at a glance whether the later supervision steps help:

    top row       training loss per supervision step over optimizer steps (smoothed, raw batches faint), and the
                  smoothed gap of every supervision step to the draft, step 1: below 0 = better than the draft
    bottom row    the same on validation: bits per byte per supervision step (on the scale of the trained model,
                  not the untrained one at optimizer step 0), and each step's gap to step 1
    right         validation bpb against the number of supervision steps run at inference: the last evaluation
                  in training, and each `python -m scripts.base_loss` result of the run (also past the trained count),
                  each labelled with how many validation tokens it read (a gap between them is the sample);
                  on a second axis the task accuracies of the latest `python -m scripts.base_eval` result

    python -m scripts.plot_run d4                 # a model tag under $NANOCHAT_BASE_DIR/base_checkpoints
    python -m scripts.plot_run path/to/run_dir    # any directory holding metrics.jsonl
"""

import glob
import json
import os
import sys

from nanochat import checkpoint as ckpt
from nanochat.cli import ArgumentParser, Exit, missing_package
from nanochat.eval.health import smooth
from nanochat.eval.loss_eval import format_steps, step_name
from nanochat.eval.metrics import MetricsError, read_metrics, read_results
from nanochat.files import exit_on_write_error, save_figure


def smoothing_beta(n):
    """An EMA spanning ~4% of the run (at least 10 optimizer steps): batch noise out, trends kept."""
    return 1 - 1 / max(10, n / 25)


def step_label(s, n):
    return step_name(s) + (" (draft)" if s == 0 else " (final)" if s == n - 1 else "")


def trained_range(values, skip):
    """(low, high) of values after the first `skip` (untrained, far higher) points, with a margin."""
    tail = values[skip:] or values
    low, high = min(tail), max(tail)
    margin = 0.08 * (high - low) or 0.05 * abs(high) or 0.01
    return low - margin, high + margin


def column(steps, rows, s):
    """(steps, values) of position s of each row that has one: with sample_n_sup the depth varies by step."""
    pairs = [(step, row[s]) for step, row in zip(steps, rows) if len(row) > s]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_train_loss(ax, train):
    steps, n = [r["step"] for r in train], max(len(r["step_losses"]) for r in train)
    smoothed = smooth([r["step_losses"] for r in train], smoothing_beta(len(train)))
    for s in range(n):
        line, = ax.plot(*column(steps, smoothed, s), lw=1.8, label=step_label(s, n))
        ax.plot(*column(steps, [r["step_losses"] for r in train], s), lw=0.5, alpha=0.2, color=line.get_color())
    ax.set_ylim(*trained_range([v for row in smoothed for v in row], n * max(1, len(train) // 20)))
    ax.set(title="training loss per supervision step (smoothed; faint: raw batches)", xlabel="optimizer step",
           ylabel="loss (nats per token)")
    ax.legend(title="supervision step", fontsize=8)


def explain_gaps(ax, n):
    text = "below the dashed line: better than the draft" if n > 1 else "one supervision step: no later step to compare"
    ax.text(0.01, 0.02, text, transform=ax.transAxes, fontsize=8, color="dimgray")


def plot_gaps(ax, train):
    steps, n = [r["step"] for r in train], max(len(r["step_losses"]) for r in train)
    gaps = [[l - r["step_losses"][0] for l in r["step_losses"][1:]] for r in train]
    smoothed = smooth(gaps, smoothing_beta(len(train)))
    ax.axhline(0, color="black", lw=1, ls="--", label="step 1 (the draft)")
    for s in range(1, n):
        line, = ax.plot(*column(steps, smoothed, s - 1), lw=1.8, label=f"{step_label(s, n)} - step 1", color=f"C{s}")
        ax.plot(*column(steps, gaps, s - 1), lw=0.5, alpha=0.15, color=line.get_color())
    values = [v for row in smoothed for v in row] + [0.0]
    ax.set_ylim(*trained_range(values, (n - 1) * max(1, len(train) // 20)))
    ax.set(title="do later supervision steps help? (training batches, smoothed)", xlabel="optimizer step",
           ylabel="loss of step s - loss of step 1 (nats)")
    explain_gaps(ax, n)
    ax.legend(title="supervision step", fontsize=8)


def trained_evals(evals):
    """The evaluations after optimizer step 0: the untrained model sits far above the rest and would squash them."""
    return [e for e in evals if e["step"] > 0] or evals


def plot_val(ax, evals):
    shown, n = trained_evals(evals), len(evals[0]["val_bpb"])
    for s in range(n):
        ax.plot([e["step"] for e in shown], [e["val_bpb"][s] for e in shown], marker="o", ms=3,
                label=step_label(s, n))
    early = len(shown) // 4  # the first quarter of training falls fast: off scale, so the end is readable
    ax.set_ylim(*trained_range([v for e in shown for v in e["val_bpb"]], n * early))
    notes = [f"untrained (optimizer step 0): {format_steps(evals[0]['val_bpb'], digits=2)}"] \
        if len(shown) < len(evals) else []
    notes += [f"evaluations up to optimizer step {shown[early - 1]['step']} above the scale"] if early else []
    ax.set(title="\n".join(["validation bits per byte per supervision step"] + notes), xlabel="optimizer step",
           ylabel="validation bpb")
    ax.legend(title="supervision step", fontsize=8)


def plot_val_gaps(ax, evals):
    shown, n = trained_evals(evals), len(evals[0]["val_bpb"])
    ax.axhline(0, color="black", lw=1, ls="--", label="step 1 (the draft)")
    for s in range(1, n):
        ax.plot([e["step"] for e in shown], [e["val_bpb"][s] - e["val_bpb"][0] for e in shown], marker="o", ms=3,
                label=f"{step_label(s, n)} - step 1", color=f"C{s}")
    ax.set(title="do later supervision steps help? (validation)", xlabel="optimizer step",
           ylabel="bpb of step s - bpb of step 1")
    explain_gaps(ax, n)
    ax.legend(title="supervision step", fontsize=8)


def run_meta(run_dir):
    """The newest checkpoint's meta.json in run_dir, or {} (a directory holding only metrics.jsonl)."""
    steps = sorted(glob.glob(os.path.join(glob.escape(run_dir), "step_*", "meta.json")))
    try:
        with open(steps[-1]) as f:
            return json.load(f)
    except (IndexError, OSError, ValueError):
        return {}


def evaluated(meta):
    """What training's evaluations read, in words: the run's --eval_tokens, rounded down to whole rows as evaluated,
    and for a fine-tuning run (chat_sft) its held-out conversations rather than the corpus."""
    config = meta.get("train_config") or {}
    if not config.get("eval_tokens") or not config.get("max_seq_len"):
        return "--eval_tokens of validation"
    tokens = max(1, config["eval_tokens"] // config["max_seq_len"]) * config["max_seq_len"]
    return f"up to {tokens:,} tokens of held-out conversations" if meta.get("init_from") else \
        f"the first {tokens:,} validation tokens"


def plot_inference(ax, evals, base_losses, n_sup_train, model_tag, meta=None):
    """Validation bpb against the supervision steps run: training's last evaluation and base_loss's, each labelled
    with the text it read, so a gap between them reads as what it is: another sample (or other data)."""
    during = evaluated(meta or {})
    if evals:
        final = evals[-1]
        ax.plot(range(1, len(final["val_bpb"]) + 1), final["val_bpb"], marker="o", color="black",
                label=f"during training, optimizer step {final['step']}: {during}")
    for r in base_losses[-4:]:
        sample = f"the first {r['split_tokens']:,} validation tokens" if "split_tokens" in r else "--split_tokens"
        ax.plot(range(1, len(r["val_bpb"]) + 1), r["val_bpb"], marker="s", ls="--",
                label=f"base_loss after training, checkpoint of step {r['step']}: {sample}")
    title = "validation bpb vs supervision steps run at inference"
    if evals and base_losses:  # one model, two numbers: say why
        title += "\n" + ("solid: held-out conversations; dashed: the corpus's validation text" if (meta or {}).get(
            "init_from") else "a gap between solid and dashed is the sample: more validation tokens, a surer number")
    ax.axvline(n_sup_train, color="gray", ls=":", label=f"trained with {n_sup_train} supervision steps")
    most = max([n_sup_train] + [len(r["val_bpb"]) for r in base_losses])
    ax.set_xticks(range(1, most + 1))
    ax.set(title=title, ylabel="validation bpb", xlabel="supervision steps run (1 = the draft alone)")
    if not base_losses:
        ax.text(0.5, 0.02, f"more steps: python -m scripts.base_loss --model_tag={model_tag} --n_sup={2 * n_sup_train}",
                transform=ax.transAxes, ha="center", fontsize=8, color="dimgray")
    ax.legend(fontsize=8)


def plot_downstream(ax, base_evals):
    """The latest base_eval's task accuracies per supervision steps run, on a second y axis (none: no axis)."""
    if not base_evals:
        return
    r = base_evals[-1]
    twin = ax.twinx()
    accuracies = {task: metrics["acc"] for task, metrics in r["tasks"].items() if "acc" in metrics}
    for i, (task, acc) in enumerate(accuracies.items()):
        # colours from C4 on: not the bpb lines' colours
        twin.plot(range(1, len(acc) + 1), acc, marker="^", ls="-.", color=f"C{(i + 4) % 10}",
                  label=f"{task} accuracy (base_eval, optimizer step {r['step']})")
    twin.set_ylabel("task accuracy (base_eval)")
    twin.legend(fontsize=8, loc="center right")


def figure(run_dir):
    """The run's figure (matplotlib), five panels: see the top of this file."""
    try:
        import matplotlib  # lazy: the optional matplotlib (the 'plot' extra); missing, one line says so
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after matplotlib.use, which must precede it
    except ImportError as e:
        raise Exit(missing_package(e, "plot_run"))
    records = read_metrics(run_dir)
    train, evals = records["train"], records["eval"]
    if not train:
        raise MetricsError(f"{run_dir}/metrics.jsonl has no training steps yet: nothing to plot")
    model_tag = os.path.basename(os.path.normpath(run_dir))
    probes = records.get("probe", [])
    fig = plt.figure(figsize=(21, 14 if probes else 10))
    grid = fig.add_gridspec(3 if probes else 2, 3)
    axes = [fig.add_subplot(grid[row, col]) for row, col in ((0, 0), (0, 1), (1, 0), (1, 1))]
    axes.append(fig.add_subplot(grid[:2, 2]))
    if probes:
        axes.append(fig.add_subplot(grid[2, :2]))
        plot_probe(axes[5], probes)
    plot_train_loss(axes[0], train)
    plot_gaps(axes[1], train)
    if evals:
        plot_val(axes[2], evals)
        plot_val_gaps(axes[3], evals)
    trained = len(evals[-1]["val_bpb"]) if evals else len(train[0]["step_losses"])  # evaluations run n_sup_train
    plot_inference(axes[4], evals, read_results(run_dir, "base_loss"), trained, model_tag, run_meta(run_dir))
    plot_downstream(axes[4], read_results(run_dir, "base_eval"))
    headline = f"{model_tag}: {train[-1]['step']} optimizer steps"
    if evals:
        headline += f"; validation bpb per supervision step at the end: {format_steps(evals[-1]['val_bpb'])}"
    fig.suptitle(headline)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_probe(ax, probes):
    """The depth probe: accuracy on the longest hop count at each supervision step, over training."""
    steps = [r["step"] for r in probes]
    for s in range(len(probes[-1]["longest_hops_by_step"])):
        ax.plot(steps, [r["longest_hops_by_step"][s] if s < len(r["longest_hops_by_step"]) else None for r in probes],
                marker="o", label=f"supervision step {s + 1}")
    ax.axhline(probes[-1]["chance"], color="gray", linestyle=":", label="chance")
    ax.set(title=f"depth probe: {probes[-1]['hops'][-1]}-hop accuracy by supervision step (climbing steps: the "
                 f"recursion uses its depth)", xlabel="optimizer step", ylabel="exact-match accuracy", ylim=(0, 1.02))
    ax.legend(fontsize=8)


def plot(run_dir, out_path):
    fig = figure(run_dir)
    import matplotlib.pyplot as plt  # lazy: optional, and figure() has checked that it is there
    try:
        save_figure(fig, out_path, dpi=100, rest=", or pick another --out")
    finally:
        plt.close(fig)
    return out_path


def main(argv=None):
    p = ArgumentParser(prog="python -m scripts.plot_run")
    p.add_argument("run", help="a model tag or a directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: <run dir>/training.png)")
    args = p.parse_args(argv)
    run_dir = args.run if os.path.isdir(args.run) else ckpt.model_dir(args.run)
    try:
        with exit_on_write_error("plot_run"):
            print(f"plot: {plot(run_dir, args.out or os.path.join(run_dir, 'training.png'))}")
    except MetricsError as e:
        raise Exit(f"plot_run: {e}")


if __name__ == "__main__":
    sys.exit(main())
