"""
The masked hops task at the regression test's budget (tests/test_hops.py: 1 block, width 32, 6 symbols, 1-3 hops,
400 steps of 32 rows, ~40 s on one core): the quickest check that a recursion climbs, for screening state updates.

python -m dev.hops_quick --state_update stream --seed 1
python -m dev.hops_quick --variant z_postnorm --config '{"detach_between_steps": false}'
"""

import argparse
import json
import random
import time

import torch

import nanochat.model.gpt
from dev.hops import FORMAT, VARIANTS, batches, chains_row, chains_vocab, evaluate, masked_row, masked_vocab, train
from nanochat.data.synthetic import HopsSpec
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train.optim import setup_optimizers

SPEC = HopsSpec(n_symbols=6, max_hops=3, n_queries=12)


# chains: 9 variables in 3 chains of 3, so guessing among a row's digits is right 1/3 of the time
ROWS = {"masked": (masked_row, masked_vocab, SPEC), "chains": (chains_row, chains_vocab, HopsSpec(9, 3, 12))}


def validation_rows(count=256):
    row, _, spec = ROWS[FORMAT["name"]]  # the format main() chose
    return batches([row(random.Random(f"val:{i}"), spec) for i in range(count)], None)


def quick_config(val, **fields):
    shape = dict(n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    _, vocab, spec = ROWS[FORMAT["name"]]
    return GPTConfig(sequence_len=val[0].size(1), vocab_size=vocab(spec), **{**shape, **fields})


def trained(config, steps, seed=0):
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    optimizers = setup_optimizers(model, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02)
    _, _, spec = ROWS[FORMAT["name"]]
    train(model, optimizers, spec, None, steps, batch=32, seed=seed, warmup=20)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state_update", default="trm")
    ap.add_argument("--variant", default="default", choices=VARIANTS, help="the layer visit (dev/hops.py)")
    ap.add_argument("--config", default="{}", help="JSON of further GPTConfig fields")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", default="masked", choices=ROWS, help="chains: the variable-binding rows (dev/hops.py)")
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(1)
    FORMAT["name"] = args.format
    nanochat.model.gpt.visit_layer = VARIANTS[args.variant]  # Block.visit looks it up at call time
    val = validation_rows()
    start = time.time()
    model = trained(quick_config(val, state_update=args.state_update, **json.loads(args.config)), args.steps,
                    args.seed)
    acc, _ = evaluate(model, val, 2 * model.config.n_sup_train, SPEC.max_hops)
    by_step = " ".join(f"{a:.2f}" for a in acc[:, SPEC.max_hops - 1].tolist())
    by_hops = " ".join(f"{a:.2f}" for a in acc[model.config.n_sup_train - 1].tolist())
    print(f"{args.format} {args.state_update} {args.variant} {args.config} seed {args.seed} ({time.time() - start:.0f} s): "
          f"{SPEC.max_hops} hops by step {by_step}; at step {model.config.n_sup_train} by hops {by_hops}")


if __name__ == "__main__":
    main()
