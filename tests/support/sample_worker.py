"""
base_train with every rank printing which of SAMPLE_PROMPTS it generates, at each sampling. Launched by
tests/test_base_train.py as

    torchrun --standalone --nproc_per_node=2 -m tests.support.sample_worker -- [base_train flags...]
"""

import os
import sys

from nanochat.model.engine import Engine
from nanochat.train.config import SAMPLE_PROMPTS
from scripts import base_train

real_generate = Engine.generate


def announced(self, prompts, **kwargs):
    texts = [self.tokenizer.decode(ids[1:]) for ids in prompts]  # less the <|bos|> each prompt starts with
    print(f"rank {os.environ['RANK']} samples prompts {[SAMPLE_PROMPTS.index(t) for t in texts]}", flush=True)
    return real_generate(self, prompts, **kwargs)


Engine.generate = announced
base_train.main(sys.argv[1:])
