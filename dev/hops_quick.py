"""
The masked hops task at the regression test's budget (tests/test_hops.py: 1 block, width 32, 6 symbols, 1-3 hops,
400 steps of 32 rows, ~40 s on one core): the quickest check that a recursion climbs, for screening state updates.
Evaluated to 4N supervision steps (N = n_sup_train); --out appends one JSON line per run (accuracy[step][hops], the
longest hops at step N every --eval_every steps while training, and the rows it took to reach 0.9 there).

python -m dev.hops_quick --seed 7                                   # the default, as in issue 51's table
python -m dev.hops_quick --recipe holding --seed 7                  # the recipe that holds past N
python -m dev.hops_quick --recipe uniform_bp2 --seed 7 --out dev/results/hops/quick.jsonl
python -m dev.hops_quick --state_update stream --seed 1
python -m dev.hops_quick --variant z_postnorm --config '{"detach_between_steps": false}'
"""

import argparse
import json
import random
import time

import torch

import nanochat.model.gpt
from dev.hops import (
    FORMAT,
    VARIANTS,
    batches,
    chains_row,
    chains_vocab,
    evaluate,
    masked_row,
    masked_vocab,
    train,
)
from nanochat.data.synthetic import HopsSpec
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train import depth
from nanochat.train.config import build_parser
from nanochat.train.depth import deepest_train_depth
from nanochat.train.optim import setup_optimizers

SPEC = HopsSpec(n_symbols=6, max_hops=3, n_queries=12)


# chains: 9 variables in 3 chains of 3, so guessing among a row's digits is right 1/3 of the time
ROWS = {"masked": (masked_row, masked_vocab, SPEC), "chains": (chains_row, chains_vocab, HopsSpec(9, 3, 12))}

UNIFORM = {"supervision_weight_base": 1.0, "improvement_reward_scale": 0.0}
# Named recipes: GPTConfig fields over the defaults (--config adds more). The rows of issue 51's table.
RECIPES = {
    "default": {},  # gpt.py's defaults, whatever they are, with base_train's step-count curriculum (CURRICULUM)
    # gpt.py's default before issue 57: the TRM's one-step detach at a fixed depth, no curriculum
    "old_default": {"sample_n_sup": False, "backprop_steps": 1},
    # issue 51's recipe that holds past N: log-normal drawn step counts, gradients through 4 steps; no curriculum
    "holding": {"sample_n_sup": "lognormal_poisson", "backprop_steps": 4},
    "uniform_bp2": {**UNIFORM, "backprop_steps": 2},  # issue 36's fastest learner
    "loop": {**UNIFORM, "n_loops": 0, "detach_between_steps": False},  # the simple loop: the block looped N times
    "plain": {"n_loops": 0, "n_sup_train": 1},  # the same block run once: the plain model of equal parameters
}
# each recipe's step-count curriculum (--depth_warmup unset): the default's is base_train's --n_sup_warmup default
CURRICULUM = {"default": build_parser().get_default("n_sup_warmup")}

def open_cap(config, step, warmup, num_iterations):
    """1 step at first, n_sup_train + 1 by `warmup`, then no cap: the draw's whole tail."""
    return rising_cap(config, step, warmup, num_iterations) if warmup and step < warmup * num_iterations else None


def full_cap(config, step, warmup, num_iterations):
    """1 step at first, rising linearly to the deepest draw by `warmup`, then no cap."""
    if not warmup or step >= warmup * num_iterations:
        return None
    return 1 + int((deepest_train_depth(config) - 1) * step / (warmup * num_iterations))


rising_cap = depth.curriculum_cap
CAPS = {"rising": rising_cap, "open": open_cap, "full": full_cap}
TARGET = 0.9  # rows-to-0.9: the rows trained until the longest hops at step N first reach this


def validation_rows(count=256):
    row, _, spec = ROWS[FORMAT["name"]]  # the format main() chose
    return batches([row(random.Random(f"val:{i}"), spec) for i in range(count)], None)


def quick_config(val, **fields):
    shape = dict(n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    _, vocab, spec = ROWS[FORMAT["name"]]
    return GPTConfig(sequence_len=val[0].size(1), vocab_size=vocab(spec), **{**shape, **fields})


def trained(config, steps, seed=0, probe=None, depth_warmup=0.0):
    """The model trained at the quick budget; probe(model) may return a train() report; depth_warmup: train()'s."""
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    optimizers = setup_optimizers(model, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02)
    _, _, spec = ROWS[FORMAT["name"]]
    train(model, optimizers, spec, None, steps, batch=32, seed=seed, warmup=20, report=probe and probe(model),
          depth_warmup=depth_warmup)
    return model


def progress_probe(val, every, longest, curve):
    """A probe for trained(): scores the longest hops at step N every `every` steps into curve, [(optimizer steps
    done, accuracy)]; evaluation draws no random numbers, so the run trains exactly as without it."""
    def probe(model):
        def report(step, aux):
            if (step + 1) % every == 0:
                acc, _ = evaluate(model, val, model.config.n_sup_train, longest)
                curve.append((step + 1, round(acc[-1, longest - 1].item(), 3)))
        return report
    return probe


def rows_to(curve, batch, target=TARGET):
    """Rows trained when the curve first reaches target (None: never within the run)."""
    return next((step * batch for step, acc in curve if acc >= target), None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="default", choices=RECIPES, help="named GPTConfig fields (RECIPES)")
    ap.add_argument("--state_update", default="trm")
    ap.add_argument("--variant", default="default", choices=VARIANTS, help="the layer visit (dev/hops.py)")
    ap.add_argument("--config", default="{}", help="JSON of further GPTConfig fields")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", default="masked", choices=ROWS, help="chains: the variable-binding rows (dev/hops.py)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval_mult", type=int, default=4, help="evaluate steps 1 .. eval_mult x N")
    ap.add_argument("--eval_every", type=int, default=0, help="score step N every this many steps (rows-to-0.9)")
    ap.add_argument("--depth_warmup", type=float, default=None, help="the step-count curriculum, as base_train's "
                    "--n_sup_warmup: at most 1 step at first, the cap rising by N every this fraction (default: the "
                    "recipe's, CURRICULUM)")
    ap.add_argument("--cap", default="rising", choices=CAPS, help="the curriculum cap's shape after its warmup "
                    "(research: rising = train/depth.py's)")
    ap.add_argument("--name", default=None, help="the run's name in --out (default: the recipe)")
    ap.add_argument("--out", default=None, help="append the run's JSON line here")
    ap.add_argument("--save", default=None, help="torch.save {config, state_dict} of the trained model here")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the same numbers on every run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    FORMAT["name"] = args.format
    nanochat.model.gpt.visit_layer = VARIANTS[args.variant]  # Block.visit looks it up at call time
    val = validation_rows()
    longest = ROWS[args.format][2].max_hops
    start = time.time()
    config = quick_config(val, state_update=args.state_update, **{**RECIPES[args.recipe], **json.loads(args.config)})
    curve = []
    probe = progress_probe(val, args.eval_every, longest, curve) if args.eval_every else None
    depth.curriculum_cap = CAPS[args.cap]  # train_depth reads it at call time
    if args.depth_warmup is None:
        args.depth_warmup = CURRICULUM.get(args.recipe, 0.0)
    model = trained(config, args.steps, args.seed, probe, args.depth_warmup)
    train_s = time.time() - start
    n = model.config.n_sup_train
    acc, answer_loss = evaluate(model, val, args.eval_mult * n, longest)
    by_step = " ".join(f"{a:.2f}" for a in acc[:, longest - 1].tolist())
    by_hops = " ".join(f"{a:.2f}" for a in acc[n - 1].tolist())
    marks = " / ".join(f"{acc[s - 1, longest - 1]:.2f}" for s in sorted({1, n, 2 * n, args.eval_mult * n}))
    print(f"{args.format} {args.recipe} {args.state_update} {args.variant} {args.config} seed {args.seed} "
          f"({train_s:.0f} s): {longest} hops at steps 1/N/2N/{args.eval_mult}N {marks}; by step {by_step}; "
          f"at step {n} by hops {by_hops}" + (f"; rows to {TARGET}: {rows_to(curve, 32)}" if curve else ""))
    if args.save:
        torch.save({"config": config.to_dict(), "state_dict": model.state_dict()}, args.save)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"name": args.name or args.recipe, "format": args.format, "recipe": args.recipe,
                                "state_update": args.state_update, "variant": args.variant,
                                "config": json.loads(args.config),
                                "depth_warmup": args.depth_warmup, "cap": args.cap, "seed": args.seed,
                                "steps": args.steps,
                                "n_sup_train": n, "train_s": round(train_s),
                                "acc": [[round(v, 3) for v in row] for row in acc.tolist()],
                                "answer_loss": [round(v, 3) for v in answer_loss.tolist()],
                                "curve": curve, "rows_to_0.9": rows_to(curve, 32) if curve else None}) + "\n")


if __name__ == "__main__":
    main()
