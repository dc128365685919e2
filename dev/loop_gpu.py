"""
Issue 51 item 6, the models and their tables (dev/loop_gpu.sh builds the data and calls this): plain, a deeper plain
of about the recursion's FLOPs, gpt.py's default with and without issue 51's holding recipe, and a
looped_nanochat-style recipe, on the offline corpus at equal tokens through scripts/compare.py.

python -m dev.loop_gpu plan a --tokens 1e8        # each model's FLOPs and its time at 40% MFU on one H100
python -m dev.loop_gpu run a --tokens 1e8          # train part a, then write OUT/table.md
python -m dev.loop_gpu table --out loop_gpu        # tokens/s and validation bpb by training step, from compare's runs
"""

import argparse
import json
import os
import statistics
import sys

from nanochat import checkpoint as ckpt
from nanochat.eval.metrics import read_metrics

# gpt.py's default, every field spelled out (so it stays that model whatever the defaults become)
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
    # issue 51's best candidate: the holding recipe (drawn step counts, gradients through 4) with the curriculum
    "holding": f"--depth=2 {DEFAULT} --sample_n_sup=lognormal_poisson --backprop_steps=4 --n_sup_warmup=0.5",
}
PARTS = {"a": ["plain2", "plain24", "loopnc"], "b": ["default", "holding"], "all": list(CONFIGS)}
SHARED = ["--n_embd=384", "--n_head=3", "--max_seq_len=2048", "--device_batch_size=16", "--compile=true",
          "--dtype=bfloat16", "--eval_tokens=1048576", "--sample_every=0"]
BATCH_TOKENS = 131072  # 64 rows of 2048
H100_BF16 = 989e12  # dense peak FLOP/s; the plan assumes 40% of it
MFU = 0.4


def compare_argv(part, tokens, out, extra=(), batch_tokens=BATCH_TOKENS):
    """scripts.compare's argv for one part: every model at `tokens` tokens, evaluated 8 times and to 4N steps."""
    configs = [a for name in CONFIGS for a in ("--config", f"{name}={CONFIGS[name]}")]
    steps = max(1, round(float(tokens) / batch_tokens))
    return ["--mode=tokens", f"--num_iterations={steps}", f"--only={','.join(PARTS[part])}", f"--out={out}",
            "--evals=8", "--inference_factor=4", *configs, "--",
            *SHARED, f"--total_batch_size={batch_tokens}", *extra]


def plan(argv, vocab_size=264):
    """[(name, training FLOPs, seconds at MFU on one H100)] of the part's models (byte-level vocabulary)."""
    from scripts import compare
    args = compare.parse_args(argv)
    return [(r.name, r.train_flops, r.train_flops / (MFU * H100_BF16))
            for r in compare.plan(args, vocab_size, 1) if r.name in args.only]


def table(out):
    """OUT/table.md: each finished model's median training tokens/s and validation bpb by training step."""
    with open(os.path.join(out, "compare.json")) as f:
        runs = json.load(f)["runs"]
    lines = ["| model | parameters | FLOPs/token | tokens/s (median step) | val bpb by training step |",
             "|---|---|---|---|---|"]
    for r in runs:
        train = read_metrics(ckpt.model_dir(r["tag"]))["train"]
        speed = statistics.median(t["tok_per_sec"] for t in train) if train else float("nan")
        curve = " ".join(f"{e['step']}:{e['final_bpb']:.4f}" for e in r["evals"])
        lines.append(f"| {r['name']} | {r['parameters']:,} | {r['flops_per_token']:.3g} | {speed:,.0f} | {curve} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    return text


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
    if args.action in ("plan", "run"):
        estimates = plan(argv)
        for name, flops, seconds in estimates:
            print(f"{name:12s} {flops:.3e} training FLOPs, {seconds / 60:.1f} min at {MFU:.0%} MFU on one H100")
        total = sum(s for *_, s in estimates) / 60
        print(f"part {args.part}: {total:.1f} min of training, plus compile and evaluation")
    if args.action == "run":
        from scripts import compare
        compare.main(argv)
    if args.action in ("run", "table"):
        print(table(args.out))


if __name__ == "__main__":
    main()
