"""
base_train with the validation loader failing on rank 1 only, as a one-row-group validation shard does on 2 ranks.
Launched by tests/test_lifecycle.py as

    torchrun --standalone --nproc_per_node=2 tests/support/lifecycle_worker.py [base_train flags...]
"""

import os
import sys

import nanochat.data.dataloader
from scripts import base_train

real_init = nanochat.data.dataloader.DataLoader.__init__


def failing_on_rank_1(self, tokenizer, B, T, split, *args, **kwargs):
    if split == "val" and os.environ["RANK"] == "1":
        raise ValueError("injected: this rank has no validation row group")
    real_init(self, tokenizer, B, T, split, *args, **kwargs)


nanochat.data.dataloader.DataLoader.__init__ = failing_on_rank_1
base_train.main(sys.argv[1:])
