"""
The CPU hops demo: does the default recursion use its depth, seed after seed? For each seed base_train trains the
default recursion (one block) on the hops corpus on one core, and with --plain the same block run once beside it (the
plain model of equal parameters) on the other; base_loss --hops scores the recursion to 4N supervision steps and the
plain block at its one step; one JSON line per run, a table, and with --plot dev/plot_hops's plot. dev/runcpu_hops.sh is
one seed of it; the corpus and training flags live here (CORPUS_FLAGS, TRAIN_FLAGS).

    python -m dev.hops_demo --seeds 42 --plain --plot --continue          # what dev/runcpu_hops.sh runs
    python -m dev.hops_demo --seeds 42-51 --out dev/results/hops/issue57/demo.jsonl      # the climb rate, 10 seeds
    python -m dev.hops_demo --seeds 60-64 --name lr --out FILE -- --matrix_lr=0.01   # flags after -- go to base_train
    python -m dev.hops_demo --table FILE                                                  # the table of a results file

A run climbs when it answers 3 hops at >= CLIMBED at step N (every run counted so far reached >= 0.96 or stayed at
chance); it holds when 3 hops at 4N is within HOLD of step N. Runs start over (--overwrite) unless --continue, which
resumes a tag that has checkpoints.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# The demo's corpus: 7-symbol cycles, 1-3 hops, each table entry one character (one lookup is one attention); at 6
# symbols the plain block answered 3 hops in one pass, at 7 it cannot (dev/LOG.md, issue 36). The training split opens
# with 9,600 documents of 1 hop, then up to 2 (--hops_curriculum): 300 steps, while the step-count curriculum trains 1,
# then 2 supervision steps.
CORPUS_FLAGS = ["--synthetic=hops_pairs", "--hops_symbols=7", "--hops_max=3", "--synthetic_docs=60000",
                "--hops_curriculum=9600"]
# One block of width 64, rows of one whole document each (<|bos|> + 105 characters; rows cut across documents kept the
# recursion on the plateau, issue 36), the learning rates of dev/hops.py's lookups, 1,000 steps of 32 documents.
TRAIN_FLAGS = ["--device_type=cpu", "--depth=1", "--n_embd=64", "--n_head=2", "--max_seq_len=105", "--rows=documents",
               "--device_batch_size=32", "--total_batch_size=3360", "--num_iterations=1000", "--warmup_steps=20",
               "--warmdown_ratio=0.3", "--matrix_lr=0.02", "--embedding_lr=0.2", "--unembedding_lr=0.004",
               "--ema_decay=0", "--eval_every=250", "--eval_tokens=8192", "--sample_every=0", "--save_every=250",
               "--keep_last=1"]
PLAIN_FLAGS = ["--n_loops=0", "--n_sup_train=1"]  # the same block, run once
CLIMBED = 0.8
HOLD = 0.05
HOPS_DOCS = 1000  # validation documents scored


def seeds_arg(text):
    """'42-51' or '42,45,47'."""
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",")]


def ensure_corpus(py, env):
    base = env["NANOCHAT_BASE_DIR"]
    # nanochat.dataset does nothing when the corpus is already this one, and refuses to mix in another one
    if subprocess.run([py, "-m", "nanochat.dataset", *CORPUS_FLAGS], env=env).returncode:
        sys.exit(f"hops_demo: {base} holds another corpus; set NANOCHAT_BASE_DIR to a new directory")
    if not os.path.isfile(os.path.join(base, "tokenizer", "tokenizer.json")):
        subprocess.run([py, "-m", "scripts.tok_train", "--byte_level"], env=env, check=True)


def has_checkpoints(base, tag):
    directory = os.path.join(base, "base_checkpoints", tag)
    return os.path.isdir(directory) and any(name.startswith("step_") for name in os.listdir(directory))


def train_and_score(py, env, tag, seed, flags, n_sup_eval, cont=False, cap="rising"):
    """Train one model on one core and score it with base_loss --hops; its results JSON and the training seconds."""
    base = env["NANOCHAT_BASE_DIR"]
    env = {**env, "OMP_NUM_THREADS": "1"}  # two runs side by side, one core each
    start = time.time()
    again = ["--resume"] if cont and has_checkpoints(base, tag) else [] if cont else ["--overwrite"]
    argv = [*TRAIN_FLAGS, f"--seed={seed}", f"--model_tag={tag}", *again, *flags]
    # research: another curriculum cap's shape (dev/hops_quick.CAPS), set before base_train runs in the process
    command = [py, "-m", "scripts.base_train", *argv] if cap == "rising" else \
        [py, "-c", f"import dev.hops_quick as q, nanochat.train.depth as d, scripts.base_train as b; "
                   f"d.curriculum_cap = q.CAPS[{cap!r}]; b.main({argv!r})"]
    with open(os.path.join(base, f"{tag}.log"), "w") as log:
        if subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"hops_demo: base_train {tag} failed: see {log.name}")
    train_s = time.time() - start
    with open(os.path.join(base, f"{tag}.eval.log"), "w") as log:
        if subprocess.run([py, "-m", "scripts.base_loss", "--device_type=cpu", f"--model_tag={tag}", "--hops",
                           f"--hops_docs={HOPS_DOCS}", f"--n_sup={n_sup_eval}"], env=env, stdout=log,
                          stderr=subprocess.STDOUT).returncode:
            sys.exit(f"hops_demo: base_loss {tag} failed: see {log.name}")
    model_dir = os.path.join(base, "base_checkpoints", tag)
    newest = sorted(f for f in os.listdir(model_dir) if f.startswith("hops_eval_step") and f.endswith(".json"))[-1]
    with open(os.path.join(model_dir, newest)) as f:
        return json.load(f), train_s


def run_seed(py, env, name, seed, flags, n_sup_eval, plain=False, cont=False, cap="rising"):
    """The recursion of one seed, and with plain=True the plain block beside it; the recursion's JSON row (with the
    plain block's 3-hop accuracy)."""
    jobs = {"trm": (f"hops_{name}_s{seed}", flags, n_sup_eval)}
    if plain:
        jobs["plain"] = (f"hops_{name}_plain_s{seed}", PLAIN_FLAGS + flags, 1)
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = {k: pool.submit(train_and_score, py, env, tag, seed, f, n, cont, cap)
                for k, (tag, f, n) in jobs.items()}
        results = {k: future.result() for k, future in done.items()}
    result, train_s = results["trm"]
    row = {"name": name, "seed": seed, "flags": flags, "train_s": round(train_s, 1),
           "n_sup_train": result["n_sup_train"], "hops": result["hops"], "accuracy": result["accuracy"],
           "answer_bpb": result["answer_bpb"], "chance": result["chance"]}
    if plain:
        row["plain_longest"] = results["plain"][0]["accuracy"][0][-1]
    return row


def verdict(row):
    """(3 hops at steps 1 / N / 2N / 4N, climbs, holds)."""
    acc, n = row["accuracy"], row["n_sup_train"]
    longest = [step[-1] for step in acc]
    at = [longest[i] for i in (0, n - 1, 2 * n - 1, 4 * n - 1) if i < len(longest)]
    climbs = longest[n - 1] >= CLIMBED
    holds = climbs and len(longest) >= 4 * n and longest[4 * n - 1] >= longest[n - 1] - HOLD
    return at, climbs, holds


def table(rows):
    """Markdown: 3 hops at steps 1 / N / 2N / 4N of each run (its plateau's accuracy at N where it did not climb), by
    name and seed, and how many climb and hold."""
    by_name = {}
    for row in rows:
        by_name.setdefault(row["name"], {})[row["seed"]] = row
    seeds = sorted({row["seed"] for row in rows})
    lines = ["| run | " + " | ".join(str(s) for s in seeds) + " | climbs | holds |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for name, runs in by_name.items():
        cells, climbed, held = [], 0, 0
        for s in seeds:
            if s not in runs:
                cells.append("")
                continue
            at, climbs, holds = verdict(runs[s])
            climbed, held = climbed + climbs, held + holds
            cells.append(" / ".join(f"{a:.2f}" for a in at) if climbs else f"plateau ({at[1]:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {climbed} of {len(runs)} | {held} of {len(runs)} |")
        plain = [runs[s]["plain_longest"] for s in seeds if s in runs and "plain_longest" in runs[s]]
        if plain:
            lines.append(f"| {name}: the plain block, 3 hops | " + " | ".join(
                f"{runs[s]['plain_longest']:.2f}" if s in runs and "plain_longest" in runs[s] else "" for s in seeds)
                + " | | |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=seeds_arg, default=[42], help="'42-51' or '42,45' (default 42)")
    p.add_argument("--name", default="trm", help="the runs' tags: hops_<name>_s<seed> (and hops_<name>_plain_s<seed>)")
    p.add_argument("--jobs", type=int, default=1, help="seeds at a time (each takes one core, two with --plain)")
    p.add_argument("--plain", action="store_true", help="train the plain block beside each recursion")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="resume a tag that has checkpoints (default: start over)")
    p.add_argument("--n_sup_eval", type=int, default=16, help="score supervision steps 1..this (4N: 16)")
    p.add_argument("--plot", action="store_true",
                   help="draw each seed's plot ($NANOCHAT_BASE_DIR/hops_demo_s<seed>.png)")
    p.add_argument("--out", help="append each run's JSON line here")
    p.add_argument("--table", metavar="FILE", help="print the table of FILE and stop")
    p.add_argument("--cap", default="rising", help=argparse.SUPPRESS)  # research: dev/hops_quick.CAPS
    args, flags = p.parse_known_args(argv)
    flags = [f for f in flags if f != "--"]
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f]))
        return
    env = {**os.environ, "NANOCHAT_BASE_DIR": os.environ.get("NANOCHAT_BASE_DIR",
                                                             os.path.expanduser("~/.cache/nanochat-hops"))}
    py = sys.executable
    ensure_corpus(py, env)

    def one(seed):
        row = run_seed(py, env, args.name, seed, flags, args.n_sup_eval, args.plain, args.cont, args.cap)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        at, climbs, holds = verdict(row)
        plain = f"; the plain block {row['plain_longest']:.2f}" if "plain_longest" in row else ""
        print(f"{args.name} seed {seed}: 3 hops at steps 1 / N / 2N / 4N {' / '.join(f'{a:.2f}' for a in at)}{plain}"
              f" ({'climbs' if climbs else 'stays on the plateau'}{', holds' if holds else ''}; trained in "
              f"{row['train_s']:.0f} s)", flush=True)
        if args.plot:
            tags = [f"hops_{args.name}_s{seed}"] + ([f"hops_{args.name}_plain_s{seed}"] if args.plain else [])
            out = os.path.join(env["NANOCHAT_BASE_DIR"], f"hops_demo_s{seed}.png")
            subprocess.run([py, "-m", "dev.plot_hops", *tags, "--out", out], env=env, check=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, args.seeds))
    if len(rows) > 1:
        print(table(rows))


if __name__ == "__main__":
    main()
