"""Shared test setup."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    # tiny ops on a loaded 2-core machine run 10-60x slower with 2 threads fighting over the cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
