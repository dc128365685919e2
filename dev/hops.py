"""
The multi-hop lookup task (nanochat.synthetic, "hops") trained in memory at CPU scale: accuracy by hops at every
supervision step, for the positive controls and the recursion ablations of dev/LOG.md.

python -m dev.hops --name trm_default --steps 1500 --seed 42                    # today's default recursion
python -m dev.hops --name plain2 --n_loops 0 --n_sup 1                           # a plain 2-layer GPT
python -m dev.hops --name loop --n_loops 0 --n_sup 4 --detach 0 --preset uniform # the 2 blocks simply looped

Byte-level tokens, one document per row (all of one length), the product's GPT, its forward_backward and optimizers
(Muon + AdamW), warmup then linear warmdown. Prints one JSON line per run (appended to --out): accuracy[step][hops]
on held-out documents for steps 1..2N, the answer-token loss per step, and the training time.
"""

import argparse
import json
import time

import torch

from nanochat.gpt import GPT, GPTConfig, REFINEMENT_PRESETS
import random

from nanochat.synthetic import HopsSpec, hops_answers, hops_documents, pairs_answers, pairs_document

FORMAT = {"answers": hops_answers}


def documents(seed, count, spec):
    if FORMAT.get("pairs"):
        rng = random.Random(f"pairs:{seed}")
        return [pairs_document(rng, spec) for _ in range(count)]
    return hops_documents(seed, count, spec)
from nanochat.tokenizer import RustBPETokenizer
from nanochat.optim import setup_optimizers


def batches(docs, tokenizer):
    """(idx, targets, answer index per row, hops per row) of byte-level documents, each starting with <|bos|>."""
    rows = [tokenizer.encode(d, prepend=tokenizer.get_bos_token_id()) for d in docs]
    ids = torch.tensor(rows)
    answers = [FORMAT["answers"](d) for d in docs]
    pos = torch.tensor([[a.position for a in ans] for ans in answers])  # char p is token p+1, predicted at p
    hops = torch.tensor([[a.hops for a in ans] for ans in answers])
    return ids[:, :-1], ids[:, 1:], pos, hops


@torch.no_grad()
def evaluate(model, data, n_steps, max_hops, batch=64):
    idx, targets, pos, hops = data
    correct = torch.zeros(n_steps, max_hops + 1)
    count = torch.zeros(max_hops + 1)
    answer_loss = torch.zeros(n_steps)
    for i in range(0, idx.size(0), batch):
        x, t, p, h = idx[i:i + batch], targets[i:i + batch], pos[i:i + batch], hops[i:i + batch]
        count += torch.bincount(h.flatten(), minlength=max_hops + 1)
        for s, (y, _) in enumerate(model.refine(x, n_steps)):
            logits = model.head(model.apply_coda(y)).gather(1, p[..., None].expand(-1, -1, model.config.vocab_size))
            want = t.gather(1, p)
            right = (logits.argmax(-1) == want).float()
            correct[s] += torch.zeros(max_hops + 1).index_add_(0, h.flatten(), right.flatten())
            answer_loss[s] += torch.nn.functional.cross_entropy(logits.flatten(0, 1), want.flatten(), reduction="sum")
    return (correct / count.clamp(min=1))[:, 1:], answer_loss / count.sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--n_head", type=int, default=2)
    ap.add_argument("--n_loops", type=int, default=2)
    ap.add_argument("--n_sup", type=int, default=4)
    ap.add_argument("--T_recursion", type=int, default=1)
    ap.add_argument("--state_update", default="trm")
    ap.add_argument("--detach", type=int, default=1)
    ap.add_argument("--preset", default="aggressive", choices=REFINEMENT_PRESETS)
    ap.add_argument("--matrix_lr", type=float, default=0.02)
    ap.add_argument("--embedding_lr", type=float, default=0.2)
    ap.add_argument("--unembedding_lr", type=float, default=0.004)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--warmdown", type=float, default=0.3)
    ap.add_argument("--max_hops", type=int, default=4)
    ap.add_argument("--n_symbols", type=int, default=12)
    ap.add_argument("--n_queries", type=int, default=16)
    ap.add_argument("--eval_docs", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--extra", default="{}", help="JSON of further GPTConfig fields")
    ap.add_argument("--answers_only", type=int, default=0, help="1: the loss reads only the answer tokens")
    ap.add_argument("--eval_every", type=int, default=0)
    ap.add_argument("--adamw", type=float, default=0.0, help="one AdamW at this lr instead of Muon + AdamW")
    ap.add_argument("--format", default="pairs", choices=["pairs", "text"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tok = RustBPETokenizer.byte_level()
    spec = HopsSpec(n_symbols=args.n_symbols, max_hops=args.max_hops, n_queries=args.n_queries)
    if args.format == "pairs":
        FORMAT.update(pairs=True, answers=pairs_answers)
    length = len(documents(0, 1, spec)[0])
    config = GPTConfig.with_refinement_preset(
        args.preset, sequence_len=length, vocab_size=tok.get_vocab_size(), n_layer=args.depth, n_head=args.n_head,
        n_kv_head=args.n_head, n_embd=args.width, n_loops=args.n_loops, n_sup_train=args.n_sup,
        T_recursion=args.T_recursion, state_update=args.state_update, detach_between_steps=bool(args.detach),
        **json.loads(args.extra))
    model = GPT(config)
    model.init_weights()
    if args.adamw:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=args.adamw, betas=(0.9, 0.98), weight_decay=0.0)]
        optimizers[0].param_groups[0]["initial_lr"] = args.adamw
    else:
        optimizers = setup_optimizers(model, unembedding_lr=args.unembedding_lr, embedding_lr=args.embedding_lr,
                                            matrix_lr=args.matrix_lr)
    val = batches(documents(10_000 + args.seed, args.eval_docs, spec), tok)
    start, log = time.time(), []
    for step in range(args.steps):
        frac = step / args.steps
        lrm = min(1.0, (step + 1) / args.warmup) * min(1.0, (1 - frac) / args.warmdown)
        for opt in optimizers:
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * lrm
        docs = documents(f"{args.seed}:{step}", args.batch, spec)
        idx, targets, pos, _ = batches(docs, tok)
        if args.answers_only:
            targets = torch.full_like(targets, -1).scatter_(1, pos, targets.gather(1, pos))
        total, aux = model.forward_backward(idx, targets)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        if args.eval_every and step % args.eval_every == 0:
            acc, _ = evaluate(model, val, args.n_sup, args.max_hops)
            print(f"{args.name} step {step} acc at step {args.n_sup} by hops {[round(v, 2) for v in acc[-1].tolist()]}",
                  flush=True)
        if step % 250 == 0 or step == args.steps - 1:
            log.append((step, [round(v, 3) for v in aux["step_losses"].tolist()]))
            print(f"{args.name} step {step} losses {log[-1][1]} {time.time() - start:.0f}s", flush=True)
    train_s = time.time() - start
    acc, answer_loss = evaluate(model, val, 2 * args.n_sup, args.max_hops)
    result = {"name": args.name, "seed": args.seed, "args": vars(args), "params": model.num_params(),
              "train_s": round(train_s), "acc": [[round(v, 3) for v in row] for row in acc.tolist()],
              "answer_loss": [round(v, 3) for v in answer_loss.tolist()], "log": log}
    trained = acc[args.n_sup - 1].tolist()
    print(f"RESULT {args.name} seed {args.seed} at step {args.n_sup}: by hops {[round(v, 2) for v in trained]}; "
          f"{args.max_hops} hops by step {[round(v, 2) for v in acc[:, -1].tolist()]}", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
