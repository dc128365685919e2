"""
The positive controls and the recursion ablations of issue 32 on the masked hops task (dev/hops.py), one named run
after another, and their table (accuracy by hops at the trained step, and on the longest hops by supervision step).

python -m dev.hops_grid --runs controls,ablations --seed 42 --out dev/results/hops/grid.jsonl
python -m dev.hops_grid --table dev/results/hops/grid.jsonl
python -m dev.hops_grid --task answers --runs loop,plain2 --seeds 42,43 --jobs 6 --device cuda   # side by side
"""

import argparse
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

# Every run: width 64, 2 heads, 8 symbols, hops 1-4; the rest is the run's own. masked: one block, batch 64, 2,000
# steps. answers: issue 36's protocol (2 blocks, batch 32, 3,000 steps, warmup steps/40, warmdown 40%, clip 1.0,
# 256 held-out rows per hop count).
TASKS = {"masked": "--depth 1 --n_symbols 8 --max_hops 4 --batch 64 --steps 2000 --eval_docs 512",
         "answers": "--format answers --depth 2 --n_symbols 8 --max_hops 4 --n_queries 8 --batch 32 --steps 3000 "
                    "--warmup 75 --warmdown 0.4 --clip 1 --eval_docs 1024"}
TASKS["answers_hidden"] = TASKS["answers"].replace("answers", "answers_hidden")  # a blank where answers stood
FIXED = '--backprop_steps 1 --extra {"sample_n_sup":false}'  # a fixed step count, detached every step: before issue 57
LOOP = f"--n_loops 0 --n_sup 4 --detach 0 --preset uniform {FIXED}"  # the same block simply looped, full gradients
DEFAULT = f"--n_loops 2 --n_sup 4 --detach 1 --preset aggressive --state_update trm {FIXED}"  # the defaults before 32
RUNS = {
    # positive controls: depth pays (plain 1 < 2 < 4 blocks), and the loop of one block reaches the deep plain model
    "plain1": "--n_loops 0 --n_sup 1 --depth 1",
    "plain2": "--n_loops 0 --n_sup 1 --depth 2",
    "plain4": "--n_loops 0 --n_sup 1 --depth 4",
    "loop": LOOP,
    # from the old default toward the loop, one piece at a time
    "old_default": DEFAULT,
    "old_default+no_detach": DEFAULT + " --detach 0",
    "old_default+residual": DEFAULT + " --state_update residual",
    "old_default+stream": DEFAULT + " --state_update stream",  # residual within a step, renormalised between steps
    "old_default+z_postnorm": DEFAULT + " --variant z_postnorm",  # z <- norm(z + D): x, y not re-added into z
    "old_default+stream+no_detach": DEFAULT + " --state_update stream --detach 0",  # credit for what a step leaves
    "old_default+no_detach+uniform": DEFAULT + " --detach 0 --preset uniform",  # trained as the loop is
    "old_default+stream+no_detach+uniform": DEFAULT + " --state_update stream --detach 0 --preset uniform",
    "old_default+uniform": DEFAULT + " --preset uniform",
    "old_default+n_loops0": DEFAULT + " --n_loops 0",
    "old_default+n_sup1": DEFAULT + " --n_sup 1",  # one supervision step: the within-step recursion alone
    "old_default+n_loops1": DEFAULT + " --n_loops 1",
    "old_default+xyz_both": DEFAULT + " --variant xyz_both",
    "old_default+no_x": DEFAULT + " --variant no_x",
    "old_default+matrix_lr/3": DEFAULT + " --matrix_lr 0.0067",  # 3x the block applications of the loop per step
    # the same, at one supervision step: what breaks inside a step (issue 36)
    **{f"old_default+n_sup1+{k}": DEFAULT + " --n_sup 1 " + v for k, v in {
        "residual": "--state_update residual", "postnorm": "--state_update postnorm", "n_loops1": "--n_loops 1",
        "xyz_both": "--variant xyz_both", "no_x": "--variant no_x", "matrix_lr/3": "--matrix_lr 0.0067"}.items()},
    # from the loop back toward the old default
    "loop+detach": LOOP + " --detach 1",
    "loop+aggressive": LOOP + " --preset aggressive",
    # truncated backpropagation: gradients through 2 steps, detached every 2nd (issue 36)
    "loop+bp2": LOOP + " --detach 1 --backprop_steps 2",
    "old_default+bp2": DEFAULT + " --backprop_steps 2",
    "old_default+bp2+uniform": DEFAULT + " --backprop_steps 2 --preset uniform",
    "old_default+n_loops1+no_detach+uniform": DEFAULT + " --n_loops 1 --detach 0 --preset uniform",
}
GROUPS = {"all": ["old_default", "loop", "plain1", "old_default+no_detach", "old_default+n_loops0", "loop+detach",
                  "loop+aggressive", "old_default+residual", "old_default+uniform", "plain2", "plain4"],
          "controls": ["plain1", "plain2", "plain4", "loop"],
          "ablations": [name for name in RUNS if name.startswith(("old_default", "loop+"))]}


def command(name, seed, out, task_extra="", suffix="", task="masked", save_dir=None):
    words = [sys.executable, "-m", "dev.hops", "--name", name + suffix, "--seed", str(seed), "--out", out,
             *TASKS[task].split(), *task_extra.split(), *RUNS[name].split()]  # later flags win: plain2's --depth too
    if save_dir:
        words += ["--save", f"{save_dir}/{name}{suffix}_seed{seed}.pt"]
    return words


def run_all(commands, jobs, log):
    """Run the commands, `jobs` at a time. Each one writes to LOG.partI while it runs (a timeout leaves those to
    read), then its output goes to `log` in one piece and its RESULT line to stdout."""
    lock = threading.Lock()

    def one(i, words):
        part = f"{log}.part{i}"
        with open(part, "w") as f:
            f.write(" ".join(words[1:]) + "\n")
            f.flush()
            code = subprocess.run(words, stdout=f, stderr=subprocess.STDOUT).returncode
        with open(part) as f:
            text = f.read()
        os.remove(part)
        with lock, open(log, "a") as f:
            f.write(text + "\n")
            print(next((line for line in text.splitlines() if line.startswith("RESULT")),
                       f"FAILED ({code}): {text[-400:]}"), flush=True)
        return code

    with ThreadPoolExecutor(jobs) as pool:
        return max(pool.map(one, range(len(commands)), commands), default=0)


def table(path):
    rows = [json.loads(line) for line in open(path)]
    print("| run | seed | params | 1 hop | 2 | 3 | 4 | 4 hops by step 1..2N | train s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        n_sup = r["args"]["n_sup"]
        trained = r["acc"][n_sup - 1]
        by_step = [row[-1] for row in r["acc"]]
        steps = " ".join(f"{v:.2f}" for v in by_step[:n_sup]) + (
            " / " + " ".join(f"{v:.2f}" for v in by_step[n_sup:]) if len(by_step) > n_sup else "")
        print(f"| {r['name']} | {r['seed']} | {r['params'] / 1e3:.0f}k | " + " | ".join(f"{v:.2f}" for v in trained)
              + f" | {steps} | {r['train_s']} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="controls", help="comma-separated run names or groups: " + ", ".join(GROUPS))
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--seeds", default=None, help="comma-separated seeds, each run on each (overrides --seed)")
    ap.add_argument("--jobs", type=int, default=1, help="runs side by side (output kept whole in OUT.log)")
    ap.add_argument("--device", default="cpu", help="dev.hops --device for every run")
    ap.add_argument("--out", default="dev/results/hops/grid.jsonl")
    ap.add_argument("--task", default="masked", choices=TASKS)
    ap.add_argument("--save_dir", default=None, help="save every trained model here (dev.hops --save)")
    ap.add_argument("--task_extra", default="", help='dev.hops flags for every run, e.g. "--depth 2 --steps 1000"')
    ap.add_argument("--suffix", default="", help="appended to every run's name, e.g. _d2")
    ap.add_argument("--table", default=None, help="print the table of this JSONL instead of running")
    args = ap.parse_args()
    if args.table:
        return table(args.table)
    names = [n for item in args.runs.split(",") for n in GROUPS.get(item, [item])]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"unknown run {unknown[0]!r}: choose from {', '.join(list(RUNS) + list(GROUPS))}")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    extra = f"{args.task_extra} --device {args.device}"
    commands = [command(name, seed, args.out, extra, args.suffix, args.task, args.save_dir)
                for name in names for seed in seeds]
    if args.jobs == 1:
        for words in commands:
            print(" ".join(words[1:]), flush=True)
            subprocess.run(words, check=True)
    else:
        sys.exit(run_all(commands, args.jobs, args.out + ".log"))


if __name__ == "__main__":
    main()
