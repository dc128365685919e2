"""
Train a halting head for a checkpoint with the model frozen (Ouro's second stage): for a model trained without
--halt_head, or to train its head longer. The trunk runs without gradients; only sigmoid(Linear(norm(y))) learns,
towards "the next supervision step no longer lowers this token's loss by more than 0.005 nats".

python -m scripts.halt_train --model_tag=d12                       # writes the new tag d12_halt
python -m scripts.base_loss --model_tag=d12_halt --halt=head:0.5   # then use it like any checkpoint

The source checkpoint is only read. The result is a new tag (--out_tag, default <model_tag>_halt) holding the same
step with the head added; an existing tag is refused, never overwritten. One process (the head is one matrix).
A new head starts at the blind guess (weight 0, its bias at the validation rate of 'halt' targets): with the model
frozen, never halting protects nothing, and from bias -5 Adam spends hundreds of steps getting there.
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split
import math
import os
import sys

import torch

from nanochat import checkpoint as ckpt
from nanochat.cli import DefaultsHelp, Exit, OneLineErrors
from nanochat.common import autocast_for, autodetect_device_type, compute_init, default_dtype, print0
from nanochat.data.dataloader import DataLoader, evaluation_batches, evaluation_size
from nanochat.files import model_tag_arg
from nanochat.model.halting import frozen_halt_head_loss

LOG_EVERY = 20


def parse_args(argv=None):
    p = OneLineErrors(prog="python -m scripts.halt_train", allow_abbrev=False, formatter_class=DefaultsHelp)
    ckpt.checkpoint_flags(p)
    p.add_argument("--out_tag", type=model_tag_arg, default=None, help="the new tag (default: <model_tag>_halt)")
    p.add_argument("--num_iterations", type=int, default=500, help="optimizer steps of the head")
    p.add_argument("--lr", type=float, default=0.001, help="AdamW learning rate of the head (0.01 overfit, dev/LOG.md)")
    p.add_argument("--device_batch_size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--max_seq_len", type=int, default=None, help="tokens per row (default: the model's sequence_len)")
    p.add_argument("--eval_tokens", type=int, default=65536, help="validation tokens for the BCE before and after")
    p.add_argument("--device_type", default="", help="cuda | cpu | mps (default: autodetect: cuda, mps, cpu)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    for name in ("num_iterations", "device_batch_size", "max_seq_len", "eval_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be >= 1")
    if not args.lr > 0:
        p.error(f"--lr={args.lr} must be > 0")
    return args


def with_halt_head(model, device):
    """(the model with a halting head, whether the head is new): its own, or a fresh one (GPT.init_weights)."""
    if model.config.halt_head:
        return model, False
    fresh = ckpt.build_model({**model.config.to_dict(), "halt_head": True}, device)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("halt_head.") for k in missing), (missing, unexpected)
    return fresh, True


@torch.no_grad()
def validation_bce(model, batches, steps, autocast):
    """(mean BCE of the head, fraction of 'halt' targets) over the validation batches."""
    bce = rate = 0.0
    for _ in range(steps):
        x, y = next(batches)
        with autocast:
            b, r = frozen_halt_head_loss(model, x, y)
        bce, rate = bce + b.item() / steps, rate + r.item() / steps
    return bce, rate


def blind_bce(rate):
    """The BCE of a head that ignores y and always says `rate`: the bar a useful head must pass."""
    rate = min(max(rate, 1e-9), 1 - 1e-9)
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def main(argv=None):
    args = parse_args(argv)
    device_type = args.device_type or autodetect_device_type()
    _, _, _, world_size, device = compute_init(device_type)
    if world_size > 1:
        raise Exit("halt_train: runs in one process (the head is one matrix); launch it with python -m, not torchrun")
    try:
        model, tokenizer, meta, model_tag, _ = ckpt.open_checkpoint(args.model_tag, args.step, device)
        out_tag = args.out_tag or f"{model_tag}_halt"
        if out_tag == model_tag:
            raise ValueError(f"--out_tag={out_tag} is the source tag; choose a new one (the source is never changed)")
        ckpt.check_fresh_start(out_tag, overwrite=False)
    except ValueError as e:
        raise Exit(f"halt_train: {e}")
    if model.config.n_sup_inference < 2:
        raise Exit(f"halt_train: {model_tag} runs {model.config.n_sup_inference} supervision step: nothing to halt")
    T = min(args.max_seq_len or model.config.sequence_len, model.config.sequence_len)
    B = args.device_batch_size
    model, fresh = with_halt_head(model, device)
    model.requires_grad_(False)
    model.halt_head.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.halt_head.parameters(), lr=args.lr, betas=(0.8, 0.95), eps=1e-10)
    autocast = autocast_for(device_type, default_dtype(device_type))
    _, eval_steps = evaluation_size(args.eval_tokens, B, T, 1)
    validation = lambda: evaluation_batches(tokenizer, B, T, "val", args.eval_tokens, 0, 1, device)
    before, rate = validation_bce(model, validation(), eval_steps, autocast)
    if fresh:  # the model is frozen, so no step needs protecting: start at the blind guess, not at never halting
        with torch.no_grad():
            model.halt_head.bias.fill_(math.log(max(rate, 1e-6) / max(1 - rate, 1e-6)))
        before = blind_bce(rate)  # what a weight-0 head at that bias scores
    print0(f"halt_train: {model_tag} step {meta['step']}, {model.config.n_sup_inference} supervision steps; val "
           f"BCE {before:.4f} before training, {blind_bce(rate):.4f} for a head blind to y ({100 * rate:.1f}% of "
           f"tokens should halt)")
    train = DataLoader(tokenizer, B, T, "train", device=device, rank=0, world_size=1)
    for step in range(1, args.num_iterations + 1):
        x, y = next(train)
        with autocast:
            bce, _ = frozen_halt_head_loss(model, x, y)
        bce.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0 or step == args.num_iterations:
            print0(f"step {step:05d}/{args.num_iterations} | halt bce {bce.item():.4f}")
    after, _ = validation_bce(model, validation(), eval_steps, autocast)
    print0(f"val BCE {after:.4f} after {args.num_iterations} steps (before {before:.4f}, blind {blind_bce(rate):.4f})")
    meta = {**meta, "model_config": model.config.to_dict(),
            "halt_train": {"from": model_tag, "step": meta["step"], "num_iterations": args.num_iterations,
                           "lr": args.lr, "tokens": args.num_iterations * B * T, "val_bce_before": before,
                           "val_bce_after": after, "val_bce_blind": blind_bce(rate), "val_halt_rate": rate}}
    try:
        path = ckpt.save_checkpoint(out_tag, meta["step"], model, [optimizer], meta, {})
    except (ckpt.CheckpointError, OSError) as e:
        raise Exit(f"halt_train: {e}")
    print0(f"saved {path}\nuse it: python -m scripts.base_loss --model_tag={out_tag} --halt=head:0.5")
    return {"before": before, "after": after, "blind": blind_bce(rate), "path": os.path.abspath(path)}


if __name__ == "__main__":
    main()
