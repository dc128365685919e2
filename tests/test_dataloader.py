"""Tokenizing loader: window shapes, exact resume, disjoint DDP ranks (also more ranks than row groups),
restartable validation, unreadable shards, batches equal to a plain reference, memory flat in the number of loaders."""

import json
import math
import os
import random
import re
import statistics
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat.data.dataloader import DataLoader, evaluation_batches, evaluation_cache, evaluation_size
from nanochat.data.dataset import DatasetError, import_corpus
from nanochat.data.tokenizer import RustBPETokenizer
from tests.conftest import WORDS
from tests.support import forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

B, T = 2, 16
MEMORY_TOLERANCE_MB = 10  # 64 loaders minus 4 on the test's corpus: 55 MB before the loaders shed row groups, 3.6 after


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """60 documents of varied length, each starting with a unique marker; returns (data dir, tokenizer)."""
    src = tmp_path_factory.mktemp("src")
    lines = [json.dumps({"text": f"doc-{i}- " + "lorem ipsum dolor sit amet " * (1 + i % 7)}) for i in range(60)]
    (src / "docs.jsonl").write_text("\n".join(lines))
    directory = tmp_path_factory.mktemp("data") / "base_data"
    import_corpus([str(src)], directory=str(directory))
    tokenizer = RustBPETokenizer.train_from_iterator(iter(json.loads(line)["text"] for line in lines), 300)
    return str(directory), tokenizer


def make_loader(corpus, split="train", **kwargs):
    directory, tokenizer = corpus
    return DataLoader(tokenizer, B, T, split, data_dir=directory, tokenizer_threads=1, tokenizer_batch_size=3, **kwargs)


def test_shapes_and_shifted_targets(corpus):
    loader = make_loader(corpus, rank=0, world_size=1)
    bos = corpus[1].get_bos_token_id()
    for _ in range(10):
        inputs, targets = next(loader)
        assert inputs.shape == targets.shape == (B, T) and inputs.dtype == targets.dtype == torch.long
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert (inputs == bos).any() or (targets == bos).any()


def test_first_window_starts_with_bos_and_first_document(corpus):
    directory, tokenizer = corpus
    inputs, _ = next(make_loader(corpus, rank=0, world_size=1))
    assert inputs[0, 0].item() == tokenizer.get_bos_token_id()
    assert tokenizer.decode(inputs[0, 1:].tolist()).startswith("doc-")


@pytest.mark.parametrize("prefetch", [False, True], ids=["here", "background"])
@pytest.mark.parametrize("rows", ["stream", "documents"])
def test_resume_reproduces_following_batches_across_epochs(corpus, rows, prefetch):
    loader = make_loader(corpus, rank=0, world_size=1, rows=rows, prefetch=prefetch)
    states, batches = [], []
    while not states or states[-1]["epoch"] < 2:  # well past an epoch boundary
        states.append(json.loads(json.dumps(loader.state_dict())))
        batches.append(next(loader))
    for i in range(0, len(batches) - 3, 5):
        resumed = make_loader(corpus, rank=0, world_size=1, resume_state=states[i], rows=rows, prefetch=prefetch)
        for inputs, targets in batches[i:i + 3]:
            got_inputs, got_targets = next(resumed)
            assert torch.equal(got_inputs, inputs) and torch.equal(got_targets, targets)


def test_document_rows_start_at_documents_hold_whole_ones_and_lose_no_token(corpus):
    """rows="documents" against the stream: the same tokens in the same order, each row from a document's start (or
    the rest of one longer than a row), a document moved to the next row rather than cut, padding unscored."""
    bos = corpus[1].get_bos_token_id()
    stream, loader = make_loader(corpus, rank=0, world_size=1), make_loader(corpus, rank=0, world_size=1,
                                                                            rows="documents")
    reference = []
    while len(reference) < 40 * B * (T + 1):
        inputs, targets = next(stream)
        reference += torch.cat([inputs[:, :1], targets], dim=1).flatten().tolist()
    starts = [i for i, t in enumerate(reference) if t == bos] + [len(reference)]
    at, padded, continued, whole = 0, 0, 0, 0
    for _ in range(30):
        inputs, targets = next(loader)
        assert torch.equal(inputs[:, 1:].clamp(min=0), targets[:, :-1].clamp(min=0)) and inputs.min() >= 0
        for row in torch.cat([inputs[:, :1], targets], dim=1).tolist():
            content = [t for t in row if t != -1]
            assert row[:len(content)] == content  # the padding only at the end
            assert content == reference[at:at + len(content)]  # nothing skipped, nothing reordered
            if row[0] == bos:
                whole += 1
            else:
                continued += 1  # the rest of a document longer than a row: only after a full row
                assert at not in starts
            at += len(content)
            if len(content) < len(row):
                padded += 1
                next_document = starts[starts.index(at) + 1] - at  # the row ended at a document's start ...
                assert next_document > len(row) - len(content)  # ... which did not fit in the rest
    assert padded and continued and whole  # the corpus exercises every case


class SlowTokenizer:
    """The tokenizer, each encode call SLOW_ENCODE_S slower (as a large batch of real documents is)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def get_bos_token_id(self):
        return self.tokenizer.get_bos_token_id()

    def encode(self, *args, **kwargs):
        time.sleep(SLOW_ENCODE_S)
        return self.tokenizer.encode(*args, **kwargs)


SLOW_ENCODE_S, STEP_S = 0.05, 0.03


def test_tokenizing_in_the_background_takes_the_slow_steps_off_the_training_loop(corpus):
    # a step of STEP_S between batches: the loader that tokenizes when it runs short makes every few batches wait
    # SLOW_ENCODE_S; tokenizing ahead in the background, no batch waits, and the batches are the same
    directory, tokenizer = corpus
    waits, batches = {}, {}
    for prefetch in (False, True):
        loader = DataLoader(SlowTokenizer(tokenizer), B, T, "train", data_dir=directory, rank=0, world_size=1,
                            tokenizer_threads=1, prefetch=prefetch)
        next(loader)  # the first read: both wait for it
        waits[prefetch], batches[prefetch] = [], []
        for _ in range(40):
            time.sleep(STEP_S)  # the device's step, during which the background thread reads
            start = time.perf_counter()
            batches[prefetch].append(next(loader))
            waits[prefetch].append(time.perf_counter() - start)
    assert max(waits[False]) >= SLOW_ENCODE_S and sum(w >= SLOW_ENCODE_S for w in waits[False]) >= 3
    assert max(waits[True]) < SLOW_ENCODE_S / 2, waits[True]
    spread = {p: max(w) - statistics.median(w) for p, w in waits.items()}
    assert spread[True] < spread[False] / 4, spread
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches[False], batches[True]))


def documents_seen_in_first_epoch(loader, tokenizer):
    """Markers of the documents in this loader's stream, up to and including the batch that crosses epoch 0."""
    tokens = []
    while loader.state_dict()["epoch"] == 0:
        inputs, targets = next(loader)
        tokens += torch.cat([inputs[:, :1], targets], dim=1).flatten().tolist()
    return set(re.findall(r"doc-(\d+)-", tokenizer.decode(tokens)))


def test_two_ranks_read_disjoint_shares_that_cover_one_rank(corpus):
    tokenizer = corpus[1]
    single = documents_seen_in_first_epoch(make_loader(corpus, rank=0, world_size=1), tokenizer)
    rank0 = documents_seen_in_first_epoch(make_loader(corpus, rank=0, world_size=2), tokenizer)
    rank1 = documents_seen_in_first_epoch(make_loader(corpus, rank=1, world_size=2), tokenizer)
    assert rank0 and rank1 and not rank0 & rank1
    assert rank0 | rank1 == single
    assert len(single) >= 50  # all but the held-out validation documents


def test_val_restarts_from_the_beginning(corpus):
    evaluations = [make_loader(corpus, "val", rank=0, world_size=1) for _ in range(2)]
    for _ in range(5):
        (a_inputs, a_targets), (b_inputs, b_targets) = (next(loader) for loader in evaluations)
        assert torch.equal(a_inputs, b_inputs) and torch.equal(a_targets, b_targets)


def test_rank_and_world_size_default_to_torchrun_environment(corpus, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torch.equal(next(make_loader(corpus))[0], next(make_loader(corpus, rank=1, world_size=2))[0])


def test_foreign_resume_state_is_refused(corpus):
    state = make_loader(corpus, rank=0, world_size=1).state_dict()
    with pytest.raises(ValueError, match="lacks"):
        make_loader(corpus, rank=0, world_size=1, resume_state={"epoch": 0})
    with pytest.raises(ValueError, match="does not read"):
        make_loader(corpus, rank=1, world_size=2, resume_state=state)


# -----------------------------------------------------------------------------
# more data ranks than row groups

def write_shards(directory, groups_per_shard):
    """Shards of documents marked doc-N-, one list of row-group sizes per shard; returns the markers per shard."""
    directory.mkdir(parents=True)
    markers, n = [], 0
    for s, sizes in enumerate(groups_per_shard):
        path = directory / f"shard_{s:05d}.parquet"
        with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
            for size in sizes:
                writer.write_table(pa.table({"text": [f"doc-{n + i}- " + "lorem ipsum " * (1 + (n + i) % 5)
                                                      for i in range(size)]}))
                n += size
        markers.append({str(i) for i in range(n - sum(sizes), n)})
    return str(directory), markers


def loaders(corpus, world_size, split="train", **kwargs):
    return [make_loader(corpus, split, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


def test_64_ranks_on_4_row_groups_are_disjoint_and_cover_the_split(tmp_path, corpus):
    directory, markers = write_shards(tmp_path / "data", [[20, 20, 20, 20], [5]])
    four_groups = (directory, corpus[1])
    shares = [documents_seen_in_first_epoch(loader, corpus[1]) for loader in loaders(four_groups, 64)]
    assert all(shares)  # every rank gets data
    assert sum(map(len, shares)) == len(set().union(*shares))  # no document is read by two ranks
    assert set().union(*shares) == markers[0]  # and together they read every train document


@pytest.mark.parametrize("rank", [0, 37, 63])
def test_64_ranks_resume_exactly(tmp_path, corpus, rank):
    directory, _ = write_shards(tmp_path / "data", [[20, 20, 20, 20], [5]])
    assert_resumes_exactly((directory, corpus[1]), rank=rank, world_size=64)


def assert_resumes_exactly(corpus, **kwargs):
    loader = make_loader(corpus, **kwargs)
    states, batches = [], []
    while not states or states[-1]["epoch"] < 3:  # past several epoch boundaries
        states.append(json.loads(json.dumps(loader.state_dict())))
        batches.append(next(loader))
    for i in range(0, len(batches) - 3, 4):
        resumed = make_loader(corpus, resume_state=states[i], **kwargs)
        for inputs, targets in batches[i:i + 3]:
            got_inputs, got_targets = next(resumed)
            assert torch.equal(got_inputs, inputs) and torch.equal(got_targets, targets)


def test_a_one_row_group_validation_shard_is_shared_by_two_ranks(tmp_path, corpus):
    directory, markers = write_shards(tmp_path / "data", [[20, 20], [6]])
    one_group = (directory, corpus[1])
    shares = [documents_seen_in_first_epoch(loader, corpus[1]) for loader in loaders(one_group, 2, "val")]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == markers[1]


def test_a_split_too_small_to_share_deals_out_batches_in_turn(tmp_path, corpus):
    # one validation document for three ranks: each reads it all and keeps every third batch of one rank's stream
    directory, _ = write_shards(tmp_path / "data", [[20], [1]])
    tiny = (directory, corpus[1])
    whole = make_loader(tiny, "val", rank=0, world_size=1)
    single = [next(whole)[0] for _ in range(12)]
    for rank, loader in enumerate(loaders(tiny, 3, "val")):
        assert all(torch.equal(next(loader)[0], single[k * 3 + rank]) for k in range(4))
    assert_resumes_exactly(tiny, split="val", rank=2, world_size=3)
    fresh = make_loader(tiny, "val", rank=2, world_size=3)  # the state before any batch already points at rank 2's
    assert torch.equal(next(make_loader(tiny, "val", rank=2, world_size=3, resume_state=fresh.state_dict()))[0],
                       single[2])


def test_unreadable_shards_are_named(tmp_path, corpus):
    directory, _ = write_shards(tmp_path / "data", [[20, 20], [20, 20], [5]])
    shard = tmp_path / "data" / "shard_00001.parquet"
    good = shard.read_bytes()
    shard.write_bytes(good[:len(good) // 2])  # truncated: no footer
    with pytest.raises(DatasetError, match=r"shard_00001.parquet: unreadable shard.*download it again"):
        make_loader((directory, corpus[1]), rank=0, world_size=1)
    damaged = bytearray(good)  # footer intact, a data page overwritten
    damaged[4:200] = b"\xff" * 196
    shard.write_bytes(bytes(damaged))
    for prefetch in (False, True):  # read in the background, the error is raised by the batch that needs it
        loader = make_loader((directory, corpus[1]), rank=0, world_size=1, prefetch=prefetch)
        with pytest.raises(DatasetError, match="shard_00001.parquet: unreadable shard"):
            for _ in range(100):
                next(loader)


# -----------------------------------------------------------------------------
# the loader against a plain reference: its rank's documents in order, <|bos|> first, cut into windows

def reference_documents(directory, split, rank, world_size):
    """(shard name, row group, doc, text) of the rank's share, in reading order: whole row groups dealt out in turn,
    or with more ranks than row groups each row group's documents dealt out to `parts` ranks in turn."""
    paths = sorted(os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".parquet"))
    paths = paths[:-1] if split == "train" else paths[-1:]
    groups = [(path, g) for path in paths for g in range(pq.ParquetFile(path).num_row_groups)]
    parts = -(-world_size // len(groups))
    shares = [(path, g, p) for path, g in groups for p in range(parts)][rank::world_size]
    return [(os.path.basename(path), g, j, text) for path, g, p in shares
            for j, text in enumerate(pq.ParquetFile(path).read_row_group(g).column("text").to_pylist())
            if j % parts == p]


def reference_stream(documents, tokenizer, num_tokens):
    """(tokens, the state of every token: where a loader resuming at it starts), epoch after epoch."""
    bos = tokenizer.get_bos_token_id()
    tokens, states, epoch = [], [], 0
    while len(tokens) < num_tokens:
        for shard, group, doc, text in documents:
            ids = tokenizer.encode(text, prepend=bos)
            tokens += ids
            states += [{"epoch": epoch, "shard": shard, "row_group": group, "doc": doc, "token": t}
                       for t in range(len(ids))]
        epoch += 1
    return tokens, states


@pytest.mark.parametrize("split, rank, world_size, batch_stride", [
    ("train", 0, 1, 1),  # one rank reads everything
    ("train", 2, 3, 1),  # whole row groups per rank
    ("train", 5, 8, 1),  # more ranks than row groups: row groups' documents dealt out
    ("val", 1, 3, 3),  # one document: every rank reads it all and keeps every third batch
])
def test_batches_and_states_equal_a_plain_reference(tmp_path, corpus, split, rank, world_size, batch_stride):
    directory, _ = write_shards(tmp_path / "data", [[20, 20, 20, 20], [1]])
    tokenizer = corpus[1]
    num_batches, window = 300, B * (T + 1)
    every_rank_reads_all = batch_stride > 1
    documents = reference_documents(directory, split, *((0, 1) if every_rank_reads_all else (rank, world_size)))
    first = rank if every_rank_reads_all else 0  # window index of the first batch

    def start(k):  # of batch k in the reference stream
        return (first + k * batch_stride) * window

    tokens, states = reference_stream(documents, tokenizer, start(num_batches + 1))
    assert states[-1]["epoch"] >= 2  # the comparison runs across epoch boundaries

    def assert_batches_from(loader, first_batch, count):
        for k in range(first_batch, first_batch + count):
            assert loader.state_dict() == states[start(k)]
            inputs, targets = next(loader)
            expected = torch.tensor(tokens[start(k):start(k) + window]).view(B, T + 1)
            assert torch.equal(inputs, expected[:, :-1]) and torch.equal(targets, expected[:, 1:])

    assert_batches_from(make_loader((directory, tokenizer), split, rank=rank, world_size=world_size), 0, num_batches)
    background = make_loader((directory, tokenizer), split, rank=rank, world_size=world_size, prefetch=True)
    assert_batches_from(background, 0, num_batches)  # tokenized ahead in a thread: the same batches and states
    mid_document = [k for k in range(num_batches) if states[start(k)]["token"]]
    for k in mid_document[::len(mid_document) // 5]:  # resuming inside a document
        resumed = make_loader((directory, tokenizer), split, rank=rank, world_size=world_size,
                              resume_state=states[start(k)])
        assert_batches_from(resumed, k, 3)


# -----------------------------------------------------------------------------
# memory: base_train holds one loader per micro-step

def write_long_documents(directory, num_groups, docs_per_group, words_per_doc):
    """One train shard of num_groups row groups of long random documents, and a one-document val shard."""
    rng = random.Random(0)
    directory.mkdir(parents=True)
    for name, groups, docs in (("shard_00000", num_groups, docs_per_group), ("shard_00001", 1, 1)):
        with pq.ParquetWriter(directory / f"{name}.parquet", pa.schema([("text", pa.string())])) as writer:
            for _ in range(groups):
                writer.write_table(pa.table({"text": [" ".join(rng.choices(WORDS, k=words_per_doc))
                                                      for _ in range(docs)]}))


def resident_mb_with_loaders(base_dir, num_loaders):
    """VmRSS of a process of its own (forked from the torch-preloaded server: the same base for every count) that
    builds the loaders of data ranks 0..num_loaders-1 and draws a batch from each."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("NANOCHAT_DATA_DIR", None)
    proc = forked.run([sys.executable, "-m", "dev.bench_data", "--loaders", str(num_loaders), "--B", str(B),
                       "--T", str(T), "--tokenizer_threads", "1"], timeout=180, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(re.search(r"after one batch each: VmRSS ([\d.]+) MB", proc.stdout).group(1))


def test_resident_memory_is_flat_in_the_number_of_loaders(tmp_path, corpus):
    # 16 row groups of ~400 kB text: a loader holding its row group or a tokenized chunk of it costs megabytes
    write_long_documents(tmp_path / "base" / "base_data", num_groups=16, docs_per_group=64, words_per_doc=1000)
    corpus[1].save(str(tmp_path / "base" / "tokenizer"))
    four, sixty_four = (resident_mb_with_loaders(tmp_path / "base", n) for n in (4, 64))
    assert sixty_four - four < MEMORY_TOLERANCE_MB, f"4 loaders: {four:.1f} MB, 64 loaders: {sixty_four:.1f} MB"


@pytest.mark.parametrize("num_tokens", [T * 11, T * 11 + T - 1, T])  # 11 rows (a short last batch), rounded, 1 row
def test_an_evaluation_reads_the_same_rows_on_any_number_of_processes(corpus, num_tokens):
    directory, tokenizer = corpus
    rows = max(1, num_tokens // T)
    reference = make_loader(corpus, "val", rank=0, world_size=1)  # the one-process evaluation: B rows at a time
    windows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in (next(reference) for _ in range(rows))])[:rows]
    for world_size in (1, 2, 3, 8):
        steps = math.ceil(math.ceil(rows / B) / world_size)
        assert evaluation_size(num_tokens, B, T, world_size) == (rows, steps)
        by_batch = {}  # global batch index -> rows
        for rank in range(world_size):
            batches = list(evaluation_batches(tokenizer, B, T, "val", num_tokens, rank, world_size, data_dir=directory))
            assert len(batches) == steps and all(x.shape == y.shape == (B, T) for x, y in batches)
            by_batch.update({i * world_size + rank: batch for i, batch in enumerate(batches)})
        x, y = (torch.cat([by_batch[g][k] for g in sorted(by_batch)]) for k in (0, 1))
        assert torch.equal(x[:rows], windows[:, :-1]) and torch.equal(y[:rows], windows[:, 1:])
        assert (y[rows:] == -1).all()  # padding: ignored targets, which evaluate_bpb counts as nothing


def test_an_evaluation_read_in_full_is_kept_and_one_stopped_early_is_not(corpus, monkeypatch):
    directory, tokenizer = corpus
    args = (tokenizer, B, T, "val", 5 * B * T, 0, 1)
    evaluation_cache.clear()
    partial = evaluation_batches(*args, data_dir=directory)
    next(partial)
    assert not evaluation_cache  # stopped after one batch of five: nothing kept
    first = list(evaluation_batches(*args, data_dir=directory))
    monkeypatch.setattr(DataLoader, "next_window", None)  # a second evaluation reads nothing
    second = list(evaluation_batches(*args, data_dir=directory))
    assert len(first) == 5 and all(torch.equal(a, b) for pair in zip(first, second) for a, b in zip(*pair))


def test_the_advice_for_a_damaged_shard_fits_the_corpus(tmp_path, corpus):
    """A shard damaged under a running loader: the message says how to rebuild this corpus (imported, built-in) or,
    for a downloaded one (no manifest, or FineWeb's), to download it again."""
    import shutil

    from nanochat.data.dataset import MANIFEST, list_parquet_files, read_source, write_source
    directory = tmp_path / "data"
    shutil.copytree(corpus[0], directory)
    imported = read_source(str(directory))
    assert imported.startswith("import: ")
    for source, advice in ((imported, f"python -m nanochat.dataset --from {imported[len('import: '):]}"),
                           ("builtin: Python 3.11.0 standard library", "python -m nanochat.dataset --builtin"),
                           ("download: karpathy/fineweb-edu-100b-shuffle", "delete it and download it again"),
                           (None, "delete it and download it again")):
        if source:
            write_source(str(directory), source)
        else:
            os.remove(directory / MANIFEST)
        loader = make_loader((str(directory), corpus[1]), rank=0, world_size=1)
        shard = list_parquet_files(str(directory))[0]
        good = open(shard, "rb").read()
        open(shard, "wb").write(good[:100])  # damaged after the loader planned its reading
        with pytest.raises(DatasetError, match="unreadable shard") as e:
            for _ in range(100):
                next(loader)
        open(shard, "wb").write(good)
        assert advice in str(e.value) and ("--builtin" in str(e.value)) == ("builtin" in advice), str(e.value)
        if source and not source.startswith("download"):
            assert f"delete the .parquet files in {directory}" in str(e.value)
