"""nanochat/data/dataset.py: reading shards, corpus import, and the built-in corpus (the download is
test_download.py's)."""

import hashlib
import json
import os
import re
import shutil
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat.data import dataset
from nanochat.data.dataset import DatasetError
from tests.support.helpers import shard_texts

pytestmark = pytest.mark.usefixtures("isolated_dirs")


def all_texts(directory):
    return [text for path in dataset.list_parquet_files(directory) for text in shard_texts(path)]


def snapshot(directory):
    """Name -> content hash of everything in a directory, to prove nothing changed."""
    return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(directory))}


# -----------------------------------------------------------------------------
# --from

def test_import_gives_shards_with_every_document(corpus_files, capsys):
    paths = [corpus_files / "one.txt", corpus_files / "dir", corpus_files / "docs.jsonl", corpus_files / "p.parquet"]
    assert dataset.main(["--from", *map(str, paths)]) == 0
    expected = ["a whole file\n\nis one document", "second doc", "third doc", "json doc 1", "json doc 2",
                "parquet doc 1", "parquet doc 2"]
    assert sorted(all_texts(dataset.data_dir())) == sorted(expected)
    assert len(dataset.parquets_for_split("val")) == 1 and shard_texts(dataset.parquets_for_split("val")[0])
    assert "wrote 2 shards (7 documents" in capsys.readouterr().out


def test_import_is_deterministic(corpus_files, tmp_path, monkeypatch):
    snapshots = []
    for name in ("run1", "run2"):
        monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / name))
        dataset.import_corpus([str(corpus_files)])
        snapshots.append(snapshot(tmp_path / name))
    assert snapshots[0] == snapshots[1]


BAD_INPUTS = {
    "missing path": (lambda src: [src / "nope.txt"], "nope.txt: no such file or directory"),
    "empty corpus": (lambda src: [src / "blank.txt"], "0 non-empty document"),
    "empty directory": (lambda src: [src / "emptydir"], "emptydir: directory holds no"),
    "unsupported file": (lambda src: [src / "notes.md"], "notes.md: unsupported file type"),
    "jsonl not json": (lambda src: [src / "bad.jsonl"], r"bad.jsonl:2: line is not valid JSON.*--skip_bad_lines"),
    "jsonl lacks text": (lambda src: [src / "notext.jsonl"], 'notext.jsonl:1: line has no string "text" field'),
    "parquet lacks text": (lambda src: [src / "cols.parquet"], r"cols.parquet: needs a string column named 'text'"),
}


@pytest.fixture
def bad_files(tmp_path):
    src = tmp_path / "bad"
    (src / "emptydir").mkdir(parents=True)
    (src / "blank.txt").write_text("  \n\n")
    (src / "notes.md").write_text("markdown")
    (src / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n{"text": "fine"}\n')
    (src / "notext.jsonl").write_text('{"body": "x"}\n')
    pq.write_table(pa.table({"body": ["x"]}), src / "cols.parquet")
    return src


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_its_message_and_changes_nothing(case, bad_files, corpus_files, tmp_path, capsys):
    dataset.import_corpus([str(corpus_files)])
    directory = dataset.data_dir()
    before = snapshot(directory)
    paths, message = BAD_INPUTS[case]
    assert dataset.main(["--from", *map(str, paths(bad_files))]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    with pytest.raises(DatasetError, match=message):
        dataset.import_corpus([str(p) for p in paths(bad_files)])
    assert snapshot(directory) == before
    assert sorted(os.listdir(os.path.dirname(directory))) == ["base_data"]  # no staging directory left


def test_skip_bad_lines_skips_and_counts(bad_files, corpus_files, capsys):
    paths = [str(bad_files / "bad.jsonl"), str(corpus_files / "one.txt")]
    assert dataset.main(["--from", *paths, "--skip_bad_lines"]) == 0
    assert "skipped 1 bad jsonl line" in capsys.readouterr().out
    assert sorted(all_texts(dataset.data_dir())) == ["a whole file\n\nis one document", "fine", "ok"]


def test_undecodable_bytes_are_replaced_and_counted(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 \xff\xfe ok \xef\xbf\xbd")  # three bad bytes, one genuine U+FFFD
    (tmp_path / "b.txt").write_text("plain")
    dataset.import_corpus([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert "replaced 3 undecodable" in capsys.readouterr().out
    assert "caf\ufffd \ufffd\ufffd ok \ufffd" in all_texts(dataset.data_dir())


def test_import_refuses_to_overwrite_a_corpus(corpus_files):
    dataset.import_corpus([str(corpus_files)])
    before = snapshot(dataset.data_dir())
    with pytest.raises(DatasetError, match="already holds"):
        dataset.import_corpus([str(corpus_files / "one.txt"), str(corpus_files / "docs.jsonl")])
    assert snapshot(dataset.data_dir()) == before


def test_split_needs_two_shards():
    with pytest.raises(DatasetError, match="python -m nanochat.dataset --builtin"):
        dataset.parquets_for_split("train")


# -----------------------------------------------------------------------------
# --builtin

def test_builtin_is_offline_deterministic_and_substantial(tmp_path, monkeypatch):
    def no_network(*args):
        raise OSError("network used by --builtin")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    snapshots = []
    for name in ("run1", "run2"):
        monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / name))
        assert dataset.main(["--builtin"]) == 0
        snapshots.append(snapshot(tmp_path / name))
    assert snapshots[0] == snapshots[1]
    train = [text for path in dataset.parquets_for_split("train") for text in shard_texts(path)]
    assert sum(map(len, train)) > 5_000_000 and len(train) > 500
    assert any("def " in text for text in train) and any("Return the" in text for text in train)
    assert len(shard_texts(dataset.parquets_for_split("val")[0])) >= 1
    assert dataset.main(["--builtin"]) == 0  # a second build is a no-op
    assert snapshot(tmp_path / "run2") == snapshots[1]


# -----------------------------------------------------------------------------
# big documents, --text_column, hf:

def test_huge_documents_never_make_more_shards_than_documents(tmp_path, monkeypatch, capsys):
    # two 15M-char files used to ask datasets for 3 train shards of 1 document; here the same sums, 1000x smaller
    monkeypatch.setattr(dataset, "CHARS_PER_SHARD", dataset.CHARS_PER_SHARD // 1000)
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(name * 15_000)
    assert dataset.main(["--from", str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]) == 0
    assert "wrote 2 shards (2 documents" in capsys.readouterr().out
    assert sorted(all_texts(dataset.data_dir())) == ["a" * 15_000, "b" * 15_000]


def test_text_column_selects_the_field_of_jsonl_and_parquet(tmp_path):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"body": "json body", "text": "not this"}) + "\n")
    pq.write_table(pa.table({"body": ["parquet body"]}), tmp_path / "p.parquet")
    dataset.import_corpus([str(tmp_path / "docs.jsonl"), str(tmp_path / "p.parquet")], text_column="body")
    assert sorted(all_texts(dataset.data_dir())) == ["json body", "parquet body"]


@pytest.fixture
def hf_saved(tmp_path):
    """A Dataset and a DatasetDict written by save_to_disk, and a directory of parquet files for load_dataset."""
    import datasets
    datasets.disable_progress_bars()
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": [f"saved doc {i}" for i in range(30)], "n": list(range(30))}).save_to_disk(
        str(saved))
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [f"train doc {i}" for i in range(20)]}),
                          "validation": datasets.Dataset.from_dict({"text": [f"val doc {i}" for i in range(5)]}),
                          }).save_to_disk(str(splits))
    files = tmp_path / "files"
    files.mkdir()
    pq.write_table(pa.table({"text": [f"file doc {i}" for i in range(10)]}), files / "part-0.parquet")
    return tmp_path


def test_import_a_dataset_saved_to_disk_by_name(hf_saved, capsys):
    spec = f"hf:{hf_saved / 'saved'}"
    assert dataset.main(["--from", spec, "--text_column", "body"]) == 0
    assert sorted(all_texts(dataset.data_dir())) == sorted(f"saved doc {i}" for i in range(30))
    assert dataset.read_source(dataset.data_dir()) == f"import: {spec}"
    assert "wrote 2 shards (30 documents" in capsys.readouterr().out


def test_import_picks_the_split_of_a_dataset_dict(hf_saved):
    dataset.import_corpus([f"hf:{hf_saved / 'splits'}::validation"])
    assert sorted(all_texts(dataset.data_dir())) == sorted(f"val doc {i}" for i in range(5))


def test_import_streams_a_dataset_through_load_dataset(hf_saved):
    # the hub path runs this same load_dataset(NAME, streaming=True) call; only the hub download is not tested here
    dataset.import_corpus([f"hf:{hf_saved / 'files'}", str(hf_saved / "files" / "part-0.parquet")])
    assert sorted(all_texts(dataset.data_dir())) == sorted(2 * [f"file doc {i}" for i in range(10)])


HF_BAD = {
    "missing column": (["hf:{d}/saved"], r"hf:.*saved: no column 'text'; its columns are: body, n \(pick one"),
    "column not text": (["hf:{d}/saved", "--text_column", "n"], r"column 'n' holds Value\('int64'\), not text"),
    "unknown split": (["hf:{d}/splits::test"], r"no split 'test'; it has train, validation"),
    "config of a saved dir": (["hf:{d}/splits:cfg"], r"has no configs; drop :cfg"),
    "bad config": (["hf:{d}/files:nocfg"], r"ValueError: BuilderConfig 'nocfg' not found"),
    "too many fields": (["hf:a:b:c:d"], r"expected hf:NAME, hf:NAME:CONFIG or hf:NAME:CONFIG:SPLIT"),
    "offline hub name": (["hf:nobody/no-such-dataset"], r"hf:nobody/no-such-dataset: ConnectionError: Couldn't reach"),
}


@pytest.mark.parametrize("case", HF_BAD)
def test_bad_hf_import_gives_one_line_and_writes_nothing(case, hf_saved, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    args, message = HF_BAD[case]
    assert dataset.main(["--from", *[a.format(d=hf_saved) for a in args]]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert re.search(message, err), err
    assert not os.path.exists(dataset.data_dir())


# -----------------------------------------------------------------------------
# The corpus' identity, recorded in checkpoints

def test_the_corpus_identity_reads_footers_only_and_changes_with_any_shard(tmp_path, monkeypatch):
    from tests.conftest import make_corpus
    make_corpus(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")

    def no_text(*args, **kwargs):
        raise AssertionError("the identity must come from the footers, not the text")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", no_text)
    monkeypatch.setattr(pq.ParquetFile, "read", no_text)
    monkeypatch.setattr(pq, "read_table", no_text)
    a = dataset.corpus_identity(str(tmp_path / "a"))
    assert a["shards"] == 3 and a["dir"] == str(tmp_path / "a") and re.fullmatch(r"[0-9a-f]{12}", a["fingerprint"])
    assert dataset.corpus_identity(str(tmp_path / "copy"))["fingerprint"] == a["fingerprint"]  # the files, not where
    monkeypatch.undo()
    replaced = tmp_path / "copy" / "shard_00001.parquet"
    pq.write_table(pa.table({"text": [t.upper() + "!" for t in shard_texts(replaced)]}), replaced)
    assert dataset.corpus_identity(str(tmp_path / "copy"))["fingerprint"] != a["fingerprint"]
    make_corpus(tmp_path / "more", num_shards=4)
    assert dataset.corpus_identity(str(tmp_path / "more"))["fingerprint"] != a["fingerprint"]


# -----------------------------------------------------------------------------
# --synthetic

HOPS = ["--synthetic=hops", "--synthetic_docs=300", "--hops_symbols=6", "--hops_max=3", "--hops_queries=5"]


def test_synthetic_hops_writes_train_and_val_shards_deterministically(tmp_path, monkeypatch, capsys):
    from nanochat.data.synthetic import HopsSpec, hops_documents
    snapshots = []
    for name in ("run1", "run2"):
        monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / name))
        assert dataset.main(HOPS + ["--seed=5"]) == 0
        snapshots.append(snapshot(tmp_path / name))
    assert snapshots[0] == snapshots[1]
    train, val = list(dataset.iter_documents("train")), list(dataset.iter_documents("val"))
    assert len(val) == 6 and len(train) == 294  # VAL_FRACTION of 300 held out
    # the very documents the generator gives for these flags, shuffled between the splits
    assert sorted(train + val) == sorted(hops_documents(5, 300, HopsSpec(n_symbols=6, max_hops=3, n_queries=5)))
    assert dataset.main(HOPS + ["--seed=5"]) == 0 and "nothing to do" in capsys.readouterr().out
    assert snapshot(tmp_path / "run2") == snapshots[1]
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "seed6"))
    assert dataset.main(HOPS + ["--seed=6"]) == 0
    assert sorted(dataset.iter_documents("val")) != sorted(val)


def test_synthetic_hops_pairs_is_the_pairs_family_and_refuses_too_many_symbols(tmp_path, monkeypatch, capsys):
    from nanochat.data.synthetic import HopsSpec, hops_documents
    flags = ["--synthetic=hops_pairs", "--synthetic_docs=50", "--hops_max=3", "--hops_queries=5"]
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "pairs"))
    assert dataset.main(flags + ["--hops_symbols=8"]) == 0
    got = sorted(list(dataset.iter_documents("train")) + list(dataset.iter_documents("val")))
    assert got == sorted(hops_documents(0, 50, HopsSpec(n_symbols=8, max_hops=3, n_queries=5), "hops_pairs"))
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "too_many"))
    assert dataset.main(flags + ["--hops_symbols=9"]) != 0
    assert "at most 8 symbols" in capsys.readouterr().err and not (tmp_path / "too_many").exists()


def test_synthetic_source_names_the_flags_that_rebuild_it(tmp_path, capsys):
    assert dataset.main(HOPS) == 0
    directory = dataset.data_dir()
    before = snapshot(directory)
    advice = dataset.rebuild_advice(directory)
    assert advice.endswith("python -m nanochat.dataset " + " ".join(HOPS[:1] + ["--seed=0"] + HOPS[1:]))
    assert dataset.main(HOPS + ["--seed=1"]) == 1  # another seed is another corpus: not mixed into this one
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "already holds 2 shard(s) of synthetic: --synthetic=hops --seed=0" in err
    assert snapshot(directory) == before


def test_a_hops_curriculum_opens_the_training_split_with_fewer_hops_and_keeps_the_validation_split(tmp_path,
                                                                                                   monkeypatch):
    from nanochat.data.synthetic import hops_answers
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "plain"))
    assert dataset.main(HOPS) == 0
    plain_train, plain_val = list(dataset.iter_documents("train")), list(dataset.iter_documents("val"))
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "curriculum"))
    assert dataset.main(HOPS + ["--hops_curriculum=100"]) == 0
    train, val = list(dataset.iter_documents("train")), list(dataset.iter_documents("val"))
    assert val == plain_val and len(train) == len(plain_train)  # the same held-out documents, as many to train on
    most = [max(a.hops for a in hops_answers(text)) for text in train]  # hops_answers: the queries' own digits
    assert most[:50] == [1] * 50 and max(most[50:100]) == 2 and 3 in most[100:]  # 1 hop, then up to 2, then all
    assert train[100:] == plain_train[100:]  # past the curriculum, the corpus without one
    assert "--hops_curriculum=100" in dataset.rebuild_advice(dataset.data_dir())


@pytest.mark.parametrize("flags, message", [
    (["--synthetic=hops", "--hops_curriculum=-1"], "--hops_curriculum=-1: must be >= 0"),
    (["--synthetic=hops", "--hops_max=1", "--hops_curriculum=10"], "--hops_curriculum=10: must be >= 0, and needs"),
    (["--synthetic=hops", "--synthetic_docs=20", "--hops_curriculum=100"], "100 curriculum documents but only"),
    (["--synthetic=sudoku"], "--synthetic=sudoku: unknown family; known: hops"),
    (["--synthetic=hops", "--hops_symbols=27"], "--hops_symbols=27: must be 2..26"),
    (["--synthetic=hops", "--hops_max=10"], "--hops_max=10: must be 1..9"),
    (["--synthetic=hops", "--hops_queries=0"], "--hops_queries=0: must be >= 1"),
    (["--synthetic=hops", "--synthetic_docs=1"], "--synthetic_docs=1: need at least 2"),
])
def test_bad_synthetic_flags_fail_in_one_line_and_write_nothing(flags, message, capsys):
    assert dataset.main(flags) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert not os.path.exists(dataset.data_dir())
