"""
Pretrain the TRM GPT.

    python -m scripts.base_train --depth=4 --num_iterations=100                      # one process
    torchrun --standalone --nproc_per_node=8 -m scripts.base_train -- --depth=12     # one node, 8 GPUs

Every step logs the final-step loss, every supervision step's loss, refinement %, gradient norm, lr, time, tokens/s,
MFU, memory, ETA and cost; evaluation measures validation bits per byte for every supervision step. Checkpoints go
to $NANOCHAT_BASE_DIR/base_checkpoints/<model_tag>/ and a killed run resumes exactly with --resume.
The run itself, stage by stage, is nanochat/trainer.py.
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split

from nanochat.checkpoint import resumable_meta
from nanochat.common import print0
from nanochat.train.config import parse_args
from nanochat.train.planning import plan_lines
from nanochat.trainer import run_or_exit, train


def main(argv=None):
    run_config = parse_args(argv, resumed_meta=resumable_meta)  # a resumed run keeps its recipe (config.py)
    if run_config.dry_run:
        print0("\n".join(plan_lines(run_config)) + "\n--dry_run: nothing was run or written")
        return
    run_or_exit("base_train", lambda: train(run_config))


if __name__ == "__main__":
    main()
