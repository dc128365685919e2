"""
How much of the loss's gradient reaches each block application of a supervision step: the mechanism behind a
recursion that cannot use its depth (dev/LOG.md, 2026-11-25).

python -m dev.depth_probe                          # today's TRM update against the residual forms, at init
python -m dev.depth_probe --train_steps 200        # the same after some training on the hops task

For every block application k of the first supervision step (in order), the RMS of d loss / d D_k, where D_k is the
block's residual branch written at that application; printed relative to the last application. A recursion whose
early applications get a vanishing share of the gradient trains like a shallow network, whatever its depth.
"""

import argparse

import torch

from nanochat.data.synthetic import HopsSpec, hops_documents
from nanochat.data.tokenizer import RustBPETokenizer
from nanochat.model import gpt
from nanochat.model.gpt import GPT, GPTConfig

VARIANTS = {  # name -> GPTConfig fields
    "trm (z, y <- norm(u + D), default before 2026-11-25)": dict(n_loops=2, state_update="trm"),
    "postnorm (state <- norm(state + D))": dict(n_loops=2, state_update="postnorm"),
    "residual (state <- state + D)": dict(n_loops=2, state_update="residual"),
    "loop (y <- y + D(y), n_loops=0)": dict(n_loops=0),
}


def recorded_deltas(model, idx, targets):
    """[RMS of d loss / d D_k for each application k of step 1], with the block's residual branch captured."""
    deltas = []
    original_delta, original_forward = gpt.Block.delta, gpt.Block.forward

    def delta(block, u, *args):
        d = original_delta(block, u, *args)
        d.retain_grad()
        deltas.append(d)
        return d

    def forward(block, u, *args):  # a plain block (n_loops=0) as u + D(u), with D captured
        return u + delta(block, u, *args)

    gpt.Block.delta, gpt.Block.forward = delta, forward
    try:
        y, _ = next(iter(model.refine(idx, 1)))
        model.step_loss(y, targets, reduction="none").mean().backward()
    finally:
        gpt.Block.delta, gpt.Block.forward = original_delta, original_forward
    return [d.grad.float().square().mean().sqrt().item() for d in deltas]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--train_steps", type=int, default=0, help="Adam steps on the hops task before measuring")
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    tok = RustBPETokenizer.byte_level()
    spec = HopsSpec(n_symbols=8, max_hops=4, n_queries=24)
    docs = hops_documents(args.seed, 16, spec)
    ids = torch.tensor([tok.encode(d, prepend=tok.get_bos_token_id()) for d in docs])
    idx, targets = ids[:, :-1], ids[:, 1:]
    for name, fields in VARIANTS.items():
        torch.manual_seed(args.seed)
        config = GPTConfig(sequence_len=idx.size(1), vocab_size=tok.get_vocab_size(), n_layer=args.depth, n_head=2,
                           n_kv_head=2, n_embd=args.width, n_sup_train=1, **fields)
        model = GPT(config)
        model.init_weights()
        torch.nn.init.normal_(model.lm_head.weight, std=0.02)  # a zero head passes no gradient into the trunk
        for block in model.blocks():  # nor do zero output projections into earlier applications
            torch.nn.init.normal_(block.attn.c_proj.weight, std=0.02)
            torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.02)
        if args.train_steps:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            for step in range(args.train_steps):
                d = hops_documents(f"{args.seed}:{step}", 16, spec)
                b = torch.tensor([tok.encode(x, prepend=tok.get_bos_token_id()) for x in d])
                loss, _ = model(b[:, :-1], b[:, 1:], n_sup=1)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        grads = recorded_deltas(model, idx, targets)
        relative = " ".join(f"{g / grads[-1]:.3f}" for g in grads)
        print(f"{name:55s} {len(grads):2d} applications; gradient RMS relative to the last: {relative}")


if __name__ == "__main__":
    main()
