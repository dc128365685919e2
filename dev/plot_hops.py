"""
Several runs' `base_loss --hops` results in one plot: the longest hop count's accuracy at every supervision step, one
line per model tag (the newest hops_eval_step<N>.json of each), and the same numbers as a table.

python -m dev.plot_hops hops_trm hops_plain --out hops.png    # what dev/runcpu_hops.sh draws
"""

import argparse
import glob
import json
import os
import sys

from nanochat import checkpoint_manager as ckpt
from nanochat.hops_eval import plot_models


def newest_result(tag):
    paths = sorted(glob.glob(os.path.join(ckpt.model_dir(tag), "hops_eval_step*.json")))
    if not paths:
        sys.exit(f"no hops_eval_step*.json for --model_tag={tag}: run `python -m scripts.base_loss --model_tag={tag} "
                 f"--hops` first")
    with open(paths[-1]) as f:
        return json.load(f)


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
    plot_models(results, args.out, title="the longest hops, by supervision step")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
