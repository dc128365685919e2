"""base_train on a disk that is full for metrics.jsonl from the start (rank 0 writes it). Launched by
tests/test_lifecycle.py as

    torchrun --standalone --nproc_per_node=2 tests/support/write_failure_worker.py RUN_DIR [base_train flags...]
"""

import sys

import pytest

from scripts import base_train
from tests.support.unwritable import FULL, fail_writes

fail_writes(pytest.MonkeyPatch(), sys.argv[1], FULL, "metrics.jsonl")
base_train.main(sys.argv[2:])
