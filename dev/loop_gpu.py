"""
Issue 51 item 6, the models and their tables (dev/loop_gpu.sh builds the data and calls this): plain, a deeper plain
of about the recursion's FLOPs, the detached default of issues 51 and before with and without issue 51's holding
recipe (issue 57's new default), and a looped_nanochat-style recipe, on the offline corpus at equal tokens through
scripts/compare.py.

python -m dev.loop_gpu plan a --tokens 1e8        # each model's FLOPs and its time at 40% MFU on one H100
python -m dev.loop_gpu run a --tokens 1e8          # train part a, then write OUT/table.md
python -m dev.loop_gpu plan c --tokens 4e7        # part c's time from the H200's measured speeds (see PART_C)
python -m dev.loop_gpu run c --tokens 4e7          # its three models at once on the one GPU, each in OUT/<model>/
python -m dev.loop_gpu table --out loop_gpu        # tokens/s and validation bpb by training step, from compare's runs
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

from nanochat import checkpoint as ckpt
from nanochat.eval.metrics import read_metrics

# the detached recipe, gpt.py's default until issue 57, every field spelled out (so it stays that model whatever the
# defaults become)
DEFAULT = ("--n_loops=2 --n_sup_train=4 --state_update=trm --sample_n_sup=false --detach_between_steps=true "
           "--backprop_steps=1 --n_sup_warmup=0 --preset=aggressive")
CONFIGS = {
    "plain2": "--depth=2 --n_loops=0 --n_sup_train=1",  # the recursion's parameters (2 blocks)
    # about the recursion's training FLOPs: 2 blocks x 3 applications x 4 supervision steps
    "plain24": "--depth=24 --n_loops=0 --n_sup_train=1",
    # looped_nanochat-like: prelude, 2 blocks looped a drawn number of times (mean 3), coda; gradients through 2
    # loops at a time; a loop-count warmup over 60% of the run; the loss on the last loop (base 100: ~1% before it)
    "loopnc": "--depth=2 --n_prelude=1 --n_coda=1 --n_loops=0 --n_sup_train=3 --sample_n_sup=lognormal_poisson "
              "--detach_between_steps=true --backprop_steps=2 --n_sup_warmup=0.6 --supervision_weight_base=100 "
              "--improvement_reward_scale=0",
    "default": f"--depth=2 {DEFAULT}",
    # issue 51's best candidate, issue 57's new default: the holding recipe (drawn step counts, gradients through 4)
    # with the curriculum
    "holding": f"--depth=2 {DEFAULT} --sample_n_sup=lognormal_poisson --backprop_steps=4 --n_sup_warmup=0.5",
    # issue 57 item 4's lever that held on CPU text and masked rows: the new default, each later step paying for its
    # move of the answer (GPTConfig.consistency_weight)
    "consist": f"--depth=2 {DEFAULT} --sample_n_sup=lognormal_poisson --backprop_steps=4 --n_sup_warmup=0.5 "
               "--consistency_weight=1.0",
    # the weaker term: at 1.0 the CPU demo stayed on its plateau on 2 seeds of 4, at 0.3 it climbed on both of them
    "consist03": f"--depth=2 {DEFAULT} --sample_n_sup=lognormal_poisson --backprop_steps=4 --n_sup_warmup=0.5 "
                 "--consistency_weight=0.3",
}
# c: issue 57 item 8, the equal-FLOPs question: the new default (holding) against the deeper plain and loopnc
# d: issue 57 item 4, do later steps stop hurting on text with the consistency term, at 1.0 or 0.3? (the longer tail
# left part d: no effect on CPU text)
PARTS = {"a": ["plain2", "plain24", "loopnc"], "b": ["default", "holding"], "c": ["holding", "plain24", "loopnc"],
         "d": ["holding", "consist", "consist03"], "all": ["plain2", "plain24", "loopnc", "default", "holding"]}
CONCURRENT = ("c", "d")  # parts whose models run at once, each in a process of its own (run_concurrently)
# the call each concurrent part is planned into: d's three recursions (~336 s at 4e7 tokens) take one 7-minute call
CALL_S = {"c": 300, "d": 420}
SHARED = ["--n_embd=384", "--n_head=3", "--max_seq_len=2048", "--device_batch_size=16", "--compile=true",
          "--dtype=bfloat16", "--eval_tokens=1048576", "--sample_every=0"]
BATCH_TOKENS = 131072  # 64 rows of 2048
H100_BF16 = 989e12  # dense peak FLOP/s; the plan assumes 40% of it
MFU = 0.4

# Part c fits one call of 5 minutes: its plan counts what one H200 measured at width 384, batch 131,072 tokens, 305
# steps (../shared/results/2026-11-28-h200/: loop_b.log for holding and default, loop_a_partial.log for plain2 and
# plain24, cut at step 228), not FLOPs at an assumed MFU:
#   tokens_per_s  the batch's tokens over the summed step times after the first: holding 304 steps in 64.96 s (613k;
#                 the median step 738k), plain24 227 steps in 56.13 s (530k; ~660k at step 150, slower later),
#                 default 304 in 79.95 s (498k). loopnc never ran: holding's FLOP rate (its mean drawn FLOPs x 613k)
#                 is assumed, at loopnc's own mean drawn FLOPs
#   compile_s     the first step's time, a cold compile: default 41.9 s (holding's own 3.0 s reused default's
#                 graphs: the same shapes), plain24 66.9 s, plain2 19.1 s; loopnc (n_loops 0: compile scope "model"
#                 over 2 blocks, as plain2) is taken as plain2's
# and, from the same runs: the evaluation twin's cold compile 18.6 s (default's clock less its steps, 27.2 s, against
# holding's 8.6 s with a warm cache; scaled by each model's training compile), an evaluation 0.86 s a 524,288 tokens
# (holding's 8.6 s for 10), and a process start (imports, CUDA, the attention probe, the data) ~20 s: part a's 265 s
# less plain2's clock (54 s), plain24's steps (123 s), its evaluations (~35 s) and ~10 s of data and tokenizer, over
# 2 starts. Three compiles at once share 16 cores: COMPILE_CONTENTION (a guess, no measurement). Sequentially the
# three cold compiles and starts alone take ~4 minutes, so part c runs its models at once (run_concurrently): the
# GPU trains them one after another in its time (no credit for overlap) as each is ready.
MEASURED_H200 = {"holding": {"tokens_per_s": 304 * 131072 / 64.96, "compile_s": 41.9},
                 "default": {"tokens_per_s": 304 * 131072 / 79.95, "compile_s": 41.9},
                 "plain24": {"tokens_per_s": 227 * 131072 / 56.13, "compile_s": 66.9},
                 "plain2": {"tokens_per_s": 304 * 131072 / 22.87, "compile_s": 19.1}}
# unmeasured: (whose FLOP rate, whose compile); the consists are holding's model and shapes with a term
ASSUMED_LIKE = {"loopnc": ("holding", "plain2"), "consist": ("holding", "holding"), "consist03": ("holding", "holding")}
PART_C = {"evals": 2, "flags": ["--eval_tokens=262144"],  # evaluation trimmed: 4 evaluations of 262,144 tokens
          "call_s": 300, "prepare_s": 10, "start_s": 20, "eval_compile_s": 18.6, "eval_s": 0.86 * 262144 / 524288,
          "sweep_s": 5, "compile_contention": 1.5}


def compare_argv(part, tokens, out, extra=(), batch_tokens=BATCH_TOKENS, only=None):
    """scripts.compare's argv for one part (only: these of its models): every model at `tokens` tokens, evaluated 8
    times (part c: PART_C's trimmed evaluation) and to 4N steps."""
    configs = [a for name in CONFIGS for a in ("--config", f"{name}={CONFIGS[name]}")]
    steps = max(1, round(float(tokens) / batch_tokens))
    evals, trimmed = (PART_C["evals"], PART_C["flags"]) if part in CONCURRENT else (8, [])
    return ["--mode=tokens", f"--num_iterations={steps}", f"--only={','.join(only or PARTS[part])}", f"--out={out}",
            f"--evals={evals}", "--inference_factor=4", *configs, "--",
            *SHARED, *trimmed, f"--total_batch_size={batch_tokens}", *extra]


def plan(argv, vocab_size=264):
    """[(name, training FLOPs, seconds at MFU on one H100)] of the part's models (byte-level vocabulary)."""
    from scripts import compare
    args = compare.parse_args(argv)
    return [(r.name, r.train_flops, r.train_flops / (MFU * H100_BF16))
            for r in compare.plan(args, vocab_size, 1) if r.name in args.only]


def plan_c(tokens, extra=(), batch_tokens=BATCH_TOKENS, vocab_size=264, part="c"):
    """A concurrent part's (c, d) time on one H200, its models at once: ([(name, ready_s, train_s, done_s)], total
    seconds). ready_s: when a model's process has started and compiled (its evaluation twin first: the eval at step
    0); train_s: its tokens at its measured speed; done_s: when the GPU, serving the models one after another as they
    are ready, finishes it and its evaluations and inference sweep."""
    from scripts import compare
    args = compare.parse_args(compare_argv(part, tokens, "out", extra, batch_tokens))
    runs = {r.name: r for r in compare.plan(args, vocab_size, 1) if r.name in args.only}
    c = PART_C
    measured = dict(MEASURED_H200)
    for name, (rate_of, compile_of) in ASSUMED_LIKE.items():
        flop_rate = measured[rate_of]["tokens_per_s"] * runs[rate_of].flops_per_token if rate_of in runs else None
        if name in runs and flop_rate:
            measured[name] = {"tokens_per_s": flop_rate / runs[name].flops_per_token,
                              "compile_s": measured[compile_of]["compile_s"]}
    rows = []
    for name, r in runs.items():
        m = measured[name]
        eval_compile = c["eval_compile_s"] * m["compile_s"] / measured["default"]["compile_s"]
        ready = c["prepare_s"] + c["start_s"] + (eval_compile + m["compile_s"]) * c["compile_contention"]
        evals = (r.iterations // max(1, r.iterations // c["evals"]) + 2) * c["eval_s"]
        rows.append([name, ready, r.tokens / m["tokens_per_s"] + evals + c["sweep_s"]])
    gpu_free = 0.0
    for row in sorted(rows, key=lambda row: row[1]):
        gpu_free = max(gpu_free, row[1]) + row[2]
        row.append(gpu_free)
    return [tuple(row) for row in rows], max(row[3] for row in rows)


def run_concurrently(part, tokens, out, extra=(), batch_tokens=BATCH_TOKENS, timeout=None):
    """Each model of the part in a scripts.compare process of its own, all at once (one GPU serves them in turn while
    the others start and compile), into OUT/<model>/ with its log OUT/<model>.log; the exit codes by model. A
    model's failure does not stop the others; all are stopped on the way out (an interrupt, the timeout)."""
    os.makedirs(out, exist_ok=True)
    procs, start = {}, time.time()
    try:
        for name in PARTS[part]:
            argv = compare_argv(part, tokens, os.path.join(out, name), extra, batch_tokens, only=[name])
            with open(os.path.join(out, f"{name}.log"), "w") as log:
                procs[name] = subprocess.Popen([sys.executable, "-m", "scripts.compare", *argv], stdout=log,
                                               stderr=subprocess.STDOUT)
        codes = {}
        while len(codes) < len(procs):
            for name, proc in procs.items():
                if name not in codes and proc.poll() is not None:
                    codes[name] = proc.returncode
                    print(f"[{time.time() - start:6.1f} s] {name}: exit {proc.returncode} (log {out}/{name}.log)",
                          flush=True)
            if timeout and time.time() - start > timeout:
                break
            time.sleep(0.5)
        return codes
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def table(out):
    """OUT/table.md: each finished model's median training tokens/s and validation bpb by training step, from
    OUT/compare.json and part c's OUT/<model>/compare.json."""
    runs = []
    for path in [os.path.join(out, "compare.json"), *sorted(glob.glob(os.path.join(out, "*", "compare.json")))]:
        if os.path.exists(path):
            with open(path) as f:
                runs += json.load(f)["runs"]
    lines = ["| model | parameters | FLOPs/token | tokens/s (median step) | val bpb by training step |",
             "|---|---|---|---|---|"]
    for r in runs:
        train = read_metrics(ckpt.model_dir(r["tag"]))["train"]
        speed = statistics.median(t["tok_per_sec"] for t in train) if train else float("nan")
        curve = " ".join(f"{e['step']}:{e['final_bpb']:.4f}" for e in r["evals"])
        lines.append(f"| {r['name']} | {r['parameters']:,} | {r['flops_per_token']:.3g} | {speed:,.0f} | {curve} |")
    if glob.glob(os.path.join(out, "*", "compare.json")):
        lines.append("\nPart c's models trained at once on one GPU: their tokens/s are shares of it, not their own "
                     "speeds.")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    return text


def print_plan_c(tokens, extra=(), batch_tokens=BATCH_TOKENS, part="c"):
    rows, total = plan_c(tokens, extra, batch_tokens, part=part)
    for name, ready, train, done in rows:
        print(f"{name:12s} ready at {ready:5.0f} s (start, compiles), {train:5.0f} s on the GPU (training at the "
              f"H200's measured speed, evaluations, sweep), done at {done:5.0f} s")
    print(f"part {part}: ~{total:.0f} s of a {CALL_S[part]} s call, its models at once on one H200 "
          f"(dev/loop_gpu.py, PART_C)")
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["plan", "run", "table"])
    ap.add_argument("part", nargs="?", default="a", choices=PARTS)
    ap.add_argument("--tokens", default="1e8")
    ap.add_argument("--out", default="loop_gpu")
    ap.add_argument("--batch_tokens", type=int, default=BATCH_TOKENS, help="tokens per optimizer step")
    argv = list(argv if argv is not None else sys.argv[1:])
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = ap.parse_args(own)  # after --: base_train flags for every model
    argv = compare_argv(args.part, args.tokens, args.out, extra, args.batch_tokens)
    if args.action in ("plan", "run") and args.part in CONCURRENT:
        print_plan_c(args.tokens, extra, args.batch_tokens, args.part)
    elif args.action in ("plan", "run"):
        estimates = plan(argv)
        for name, flops, seconds in estimates:
            print(f"{name:12s} {flops:.3e} training FLOPs, {seconds / 60:.1f} min at {MFU:.0%} MFU on one H100")
        total = sum(s for *_, s in estimates) / 60
        print(f"part {args.part}: {total:.1f} min of training, plus compile and evaluation")
    if args.action == "run" and args.part in CONCURRENT:
        codes = run_concurrently(args.part, args.tokens, args.out, extra, args.batch_tokens)
        if any(codes.values()):
            print(f"loop_gpu: part {args.part}: {', '.join(n for n, c in codes.items() if c)} failed (see their logs)")
    elif args.action == "run":
        from scripts import compare
        compare.main(argv)
    if args.action in ("run", "table"):
        print(table(args.out))


if __name__ == "__main__":
    main()
