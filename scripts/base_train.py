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
import sys

from nanochat.cli import Exit, ExitCode
from nanochat.common import compute_cleanup, print0
from nanochat.eval.metrics import MetricsError
from nanochat.files import WriteError
from nanochat.train.config import parse_args
from nanochat.train.planning import plan_lines
from nanochat.trainer import train


def main(argv=None):
    run_config = parse_args(argv)
    if run_config.dry_run:
        print0("\n".join(plan_lines(run_config)) + "\n--dry_run: nothing was run or written")
        return
    try:
        train(run_config)
    except (Exit, MetricsError, WriteError) as e:
        sys.stderr.write(f"base_train: {e}\n")  # one write: the line and its newline stay together beside other ranks
        sys.stderr.flush()
        compute_cleanup()
        sys.exit(getattr(e, "exit_code", ExitCode.FAILED))
    compute_cleanup(together=True)


if __name__ == "__main__":
    main()
