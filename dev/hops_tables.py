"""
Markdown tables of dev.hops_quick / dev.hops JSON lines (issue 51): the longest hops' accuracy at supervision steps
1 / N / 2N / 4N by run name and seed, the drop from N to 4N, and the rows each run needed to reach 0.9 at step N.

python -m dev.hops_tables dev/results/hops/issue51/screen.jsonl dev/results/hops/issue51/confirm.jsonl
python -m dev.hops_tables dev/results/hops/issue51/vchains.jsonl --by_depth     # accuracy by depth x step
"""

import argparse
import json
from collections import defaultdict


def marks(acc, n):
    """The longest hops at steps 1, N, 2N and 4N (as far as the run was evaluated)."""
    longest = [row[-1] for row in acc]
    return [longest[s - 1] for s in (1, n, 2 * n, 4 * n) if s <= len(longest)]


def stability_table(runs):
    by_name = defaultdict(dict)
    for r in runs:
        by_name[r["name"]][r["seed"]] = r
    seeds = sorted({r["seed"] for r in runs})
    lines = ["| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean drop N -> 4N |",
             "|---" * (len(seeds) + 2) + "|"]
    for name, by_seed in by_name.items():
        cells, drops = [], []
        for s in seeds:
            r = by_seed.get(s)
            if r is None:
                cells.append("")
                continue
            m = marks(r["acc"], r["n_sup_train"])
            cells.append(" / ".join(f"{v:.2f}" for v in m))
            if len(m) == 4:
                drops.append(m[1] - m[3])
        mean = f"{sum(drops) / len(drops):+.2f}" if drops else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)


def rows_table(runs):
    by_name = defaultdict(dict)
    for r in runs:
        by_name[r["name"]][r["seed"]] = r.get("rows_to_0.9")
    seeds = sorted({r["seed"] for r in runs})
    lines = ["| run | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---" * (len(seeds) + 1) + "|"]
    for name, by_seed in by_name.items():
        cells = [("-" if s not in by_seed else "never" if by_seed[s] is None else f"{by_seed[s]:,}") for s in seeds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def depth_table(run):
    """One dev.hops run: accuracy by depth (columns) at every supervision step (rows), chance last."""
    depths = len(run["acc"][0])
    lines = [f"{run['name']} seed {run['seed']}", "| step | " + " | ".join(f"depth {d}" for d in range(1, depths + 1))
             + " |", "|---" * (depths + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(f"{v:.2f}" for v in row) + " |" for s, row in enumerate(run["acc"], start=1)]
    if run.get("chance"):
        lines.append("| chance | " + " | ".join(f"{c:.2f}" for c in run["chance"]) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--by_depth", action="store_true", help="one accuracy-by-depth table per run (dev.hops lines)")
    args = ap.parse_args(argv)
    runs = [json.loads(line) for path in args.files for line in open(path) if line.strip()]
    if args.by_depth:
        print("\n\n".join(depth_table(r) for r in runs))
        return
    print(stability_table(runs))
    print()
    print(rows_table(runs))


if __name__ == "__main__":
    main()
