"""
A research lever for issue 57 item 4 (later steps never hurt): a consistency term on the recursion's answer state.
Each supervision step from the second on pays weight x ||y_s - sg(y_{s-1})||^2 / ||sg(y_{s-1})||^2 (mean over
positions) beside its cross-entropy, so a step changes the answer only as far as its loss pays for the change: the
state's fixed point is pulled toward the early step that reached it instead of drifting past it. The first step's
update (from the embedding) is free. Installed over GPT's training path for one process; not part of the product.

python -m dev.consistency --weight 1.0 -- --device_type=cpu --depth=4 ...   # base_train with the term
"""

import argparse
import contextlib

import torch

from nanochat.model.gpt import GPT


def relative_update(y, previous):
    """||y - previous||^2 / ||previous||^2 per position, averaged: 0 for a step that does not move the answer."""
    y, previous = y.float(), previous.float()
    return ((y - previous).square().sum(-1) / previous.square().sum(-1).clamp(min=1e-12)).mean()


@contextlib.contextmanager
def installed(weight):
    """Within the block, every training step loss from the second on (GPT.step_loss with gradients, reduction mean)
    carries the term; GPT's methods are restored after it. The reported step losses include the term; evaluations
    (no gradients) do not."""
    if not weight:  # nothing installed: the run is bit-identical to one without this module
        yield
        return
    forward_backward, step_loss = GPT.forward_backward, GPT.step_loss

    def with_fresh_state(self, *args, **kwargs):
        self._consistency_previous = None  # each micro-step's recursion starts from the embedding
        return forward_backward(self, *args, **kwargs)

    def with_consistency(self, y, targets, reduction="mean"):
        loss = step_loss(self, y, targets, reduction)
        if reduction != "mean" or not torch.is_grad_enabled() or not hasattr(self, "_consistency_previous"):
            return loss
        previous = self._consistency_previous
        self._consistency_previous = y.detach()
        return loss if previous is None else loss + weight * relative_update(y, previous)

    GPT.forward_backward, GPT.step_loss = with_fresh_state, with_consistency
    try:
        yield
    finally:
        GPT.forward_backward, GPT.step_loss = forward_backward, step_loss


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dev.consistency", description=__doc__.splitlines()[1])
    ap.add_argument("--weight", type=float, required=True, help="the term's weight (0: base_train unchanged)")
    ap.add_argument("base_train_args", nargs=argparse.REMAINDER, help="after --: base_train's flags")
    args = ap.parse_args(argv)
    from scripts import base_train
    rest = args.base_train_args[1:] if args.base_train_args[:1] == ["--"] else args.base_train_args
    with installed(args.weight):
        return base_train.main(rest)


if __name__ == "__main__":
    main()
