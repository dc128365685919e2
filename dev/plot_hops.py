"""
Several runs' `base_loss --hops` results in one plot: the longest hop count's accuracy at every supervision step, one
line per model tag (the newest hops_eval_step<N>.json of each), and the same numbers as a table.

python -m dev.plot_hops hops_trm_s42 hops_plain_s42 --out hops.png    # what dev/runcpu_hops.sh draws

A run whose one-hop accuracy never leaves chance gets a WARNING line, printed and on the plot: it has not left the loss
plateau. The plot marks the trained step count N: steps right of it the recursion never trained.
"""

import argparse
import glob
import json
import os
import sys

from nanochat import checkpoint as ckpt
from nanochat.eval.hops_eval import plot_models


def newest_result(tag):
    paths = sorted(glob.glob(os.path.join(ckpt.model_dir(tag), "hops_eval_step*.json")))
    if not paths:
        sys.exit(f"no hops_eval_step*.json for --model_tag={tag}: run `python -m scripts.base_loss --model_tag={tag} "
                 f"--hops` first")
    with open(paths[-1]) as f:
        return json.load(f)


LEARNED = 0.5  # one hop at or above this at some step: the run learned a single lookup (chance is 1/symbols)


def plateau_warning(tag, result):
    """A line when a run never learned even the one-hop lookup: it stayed on the loss plateau (docs/reasoning.md),
    so its longer hops say nothing about depth; None otherwise."""
    if 1 not in result["hops"]:
        return None
    one_hop = max(row[result["hops"].index(1)] for row in result["accuracy"])
    if one_hop >= LEARNED:
        return None
    return (f"WARNING {tag}: 1 hop at {one_hop:.2f} at best (chance {result['chance']:.2f}): it never learned a single "
            "lookup, it is still on the loss plateau, so its longer hops say nothing about depth; train it longer or "
            "from another --seed")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tags", nargs="+", help="model tags under $NANOCHAT_BASE_DIR/base_checkpoints")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args(argv)
    results = {tag: newest_result(tag) for tag in args.tags}
    steps = max(len(r["accuracy"]) for r in results.values())
    print(f"accuracy on the longest hops by supervision step 1..{steps}")
    for tag, r in results.items():
        print(f"{tag:>16s} ({r['hops'][-1]} hops): " + " ".join(f"{row[-1]:.2f}" for row in r["accuracy"]))
    warnings = [w for tag, r in results.items() if (w := plateau_warning(tag, r))]
    for warning in warnings:
        print(warning)
    plot_models(results, args.out, title="the longest hops, by supervision step", warnings=warnings)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
