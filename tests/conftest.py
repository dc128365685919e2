"""Shared test setup: one torch thread, and a tiny corpus with a tiny tokenizer."""

import json
import os
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

WORDS = "the a model data refine step loss token draft answer of to in is was by with layer sweep".split()


# The files with the longest single tests (--durations of dev/test.sh, 2026-11-29), handed to the workers first
# (dev/test.sh's --no-loadscope-reorder keeps this order): the suite ends when its last file does, and xdist's own
# order (most tests first) started the hops file, a few tests and ~2.5 minutes, last
LONGEST_FIRST = ("test_hops.py", "test_launch.py", "test_hops_demo.py", "test_process_group_timeout.py",
                 "test_lifecycle.py", "test_compare.py", "test_loop_gpu.py", "test_gpu_check.py", "test_fsdp.py",
                 "test_base_train.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    count = {}
    for item in items:
        count[item.path] = count.get(item.path, 0) + 1
    # then xdist's own rule, most tests first; stable, so each file's tests keep their order
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path]))


def pytest_unconfigure(config):
    # the fork server (tests/support/forked.py) and anything it still runs end with the session, waited for here
    forked = sys.modules.get("tests.support.forked")
    if forked is not None:
        forked.stop()


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    # tiny ops on a loaded 2-core machine run 10-60x slower with 2 threads fighting over the cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_corpus(directory, num_shards=3, groups_per_shard=4, docs_per_group=20):
    """Small shards with several row groups each, so every data rank of a 2x2 run has its own row groups."""
    rng = random.Random(0)
    os.makedirs(directory, exist_ok=True)
    for s in range(num_shards):
        writer = None
        path = os.path.join(directory, f"shard_{s:05d}.parquet")
        for _ in range(groups_per_shard):
            docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(docs_per_group)]
            table = pa.table({"text": docs})
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
        writer.close()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A NANOCHAT_BASE_DIR with shards and a tiny tokenizer, shared by this module's runs."""
    from nanochat.data.tokenizer import RustBPETokenizer
    base = tmp_path_factory.mktemp("base")
    make_corpus(os.path.join(base, "base_data"))
    texts = pq.read_table(os.path.join(base, "base_data", "shard_00000.parquet")).column("text").to_pylist()
    RustBPETokenizer.train_from_iterator(iter(texts), 300).save(os.path.join(base, "tokenizer"))
    return str(base)


# The dataset and download tests: each in a base directory of its own, with a corpus of every importable kind
@pytest.fixture
def isolated_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


@pytest.fixture
def corpus_files(tmp_path):
    src = tmp_path / "src"
    (src / "dir" / "sub").mkdir(parents=True)
    (src / "one.txt").write_text("a whole file\n\nis one document")
    (src / "dir" / "two.txt").write_text("second doc")
    (src / "dir" / "sub" / "three.txt").write_text("third doc")
    (src / "dir" / "ignored.md").write_text("not imported")
    (src / "docs.jsonl").write_text(json.dumps({"text": "json doc 1", "id": 1}) + "\n\n" +
                                    json.dumps({"text": "json doc 2"}) + "\n")
    pq.write_table(pa.table({"text": ["parquet doc 1", None, "parquet doc 2"], "n": [1, 2, 3]}), src / "p.parquet")
    return src


@pytest.fixture(scope="module")
def trained_tiny(base_dir):
    """base_dir with a tiny TRM checkpoint 'halt' (3 supervision steps, no halting head), trained one step."""
    from scripts import base_train
    from tests.support import helpers
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", base_dir)
        base_train.main(helpers.TINY + ["--n_sup_train=3", "--num_iterations=1", "--eval_every=0",
                                        "--model_tag=halt"])
    return base_dir
