"""An exponential moving average of a model's weights, for base_train --ema_decay: evaluated, sampled and published
while training goes on in the model itself.

Written here rather than taken from torch.optim.swa_utils.AveragedModel: that one reads its step counter from a tensor
on every update (two host syncs per optimizer step on a GPU). The arithmetic is the same as its
get_ema_multi_avg_fn: the first update copies, each later one is ema <- ema + (1 - decay) * (w - ema).
"""

import copy

import torch

from nanochat.train.optim import local


class WeightAverage(torch.nn.Module):

    def __init__(self, model, decay, module=None):
        """module: the average's own model, shaped (and sharded) as `model`, given its weights here; default a deep copy
        (a model sharded by FSDP cannot be deep-copied: build and shard another)."""
        super().__init__()
        self.module = copy.deepcopy(model) if module is None else module
        if module is not None:
            with torch.no_grad():
                torch._foreach_copy_(self._weights(module), self._weights(model))
        self.decay = decay
        self.started = False  # a Python flag, not a tensor: reading it costs no sync

    @torch.no_grad()
    def update_parameters(self, model):
        averaged, current = self._weights(self.module), self._weights(model)
        if self.started:
            torch._foreach_lerp_(averaged, current, 1 - self.decay)
        else:
            torch._foreach_copy_(averaged, current)
            self.started = True

    @staticmethod
    def _weights(model):
        """model's parameters, or this rank's shards of them (the average of a sharded model stays sharded)."""
        return [local(p.detach()) for p in model.parameters()]
