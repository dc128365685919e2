"""Shard download (against a fault-injecting local server), corpus import, and the built-in corpus."""

import hashlib
import http.server
import json
import os
import socket
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset
from nanochat.dataset import DatasetError


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def shard_texts(path):
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


def all_texts(directory):
    return [text for path in dataset.list_parquet_files(directory) for text in shard_texts(path)]


def snapshot(directory):
    """Name -> content hash of everything in a directory, to prove nothing changed."""
    return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(directory))}


# -----------------------------------------------------------------------------
# download

class FaultyHub:
    """Serves parquet bytes by file name; `faults[name]` lists failures to inject, one per request, before success."""

    def __init__(self, files):
        self.files, self.faults, self.requests = files, {}, []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = os.path.basename(self.path)
                hub.requests.append(name)
                fault = hub.faults.get(name, []).pop(0) if hub.faults.get(name) else None
                body = hub.files.get(name)
                if fault == "drop":
                    self.close_connection = True  # no status line at all: the client sees a dropped connection
                    return
                if fault in (500, 429, 404) or body is None:
                    self.send_response(fault or 404)
                    if fault == 429:
                        self.send_header("Retry-After", "0")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:len(body) // 2] if fault == "short" else body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def parquet_bytes(texts, tmp_path):
    path = tmp_path / "src.parquet"
    pq.write_table(pa.table({"text": texts}), path)
    return path.read_bytes()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    names = [dataset.shard_name(i) for i in range(4)] + [dataset.shard_name(dataset.MAX_SHARD)]
    server = FaultyHub({name: parquet_bytes([f"{name} doc {i}" for i in range(50)], tmp_path) for name in names})
    monkeypatch.setenv("NANOCHAT_HF_ENDPOINT", server.url)
    yield server
    server.server.shutdown()


def test_download_survives_transient_faults_and_resumes(hub):
    hub.faults = {"shard_00000.parquet": [500], "shard_00001.parquet": [429],
                  "shard_00002.parquet": ["short"], "shard_00003.parquet": ["drop"]}
    paths = dataset.download_shards(4, workers=2, base_delay=0.01)
    directory = dataset.data_dir()
    assert paths == dataset.list_parquet_files()
    assert [os.path.basename(p) for p in paths] == sorted(hub.files)
    for path in paths:
        assert shard_texts(path)[0].startswith(os.path.basename(path))
    assert sorted(os.listdir(directory)) == sorted([*hub.files, dataset.MANIFEST])  # no temporary files
    assert hub.requests.count("shard_00002.parquet") == 2
    hub.requests.clear()
    dataset.download_shards(4, workers=2, base_delay=0.01)
    assert hub.requests == []  # everything was complete: nothing fetched again


def test_download_404_fails_at_once_naming_file_and_url(hub, capsys):
    hub.files.pop("shard_00001.parquet")
    assert dataset.main(["-n", "2", "-w", "2"]) == 1
    err = capsys.readouterr().err
    assert "shard_00001.parquet: HTTP 404" in err and f"{hub.url}/datasets/{dataset.REPO_ID}" in err
    assert hub.requests.count("shard_00001.parquet") == 1  # permanent: not retried
    names = sorted(os.listdir(dataset.data_dir()))
    assert names == ["corpus.json", "shard_00000.parquet", "shard_01822.parquet"]


def test_corrupt_shard_found_at_startup_is_refetched(hub):
    directory = dataset.data_dir()
    os.makedirs(directory)
    with open(os.path.join(directory, "shard_00000.parquet"), "wb") as f:
        f.write(b"PAR1 truncated")
    dataset.download_shards(1, base_delay=0.01)
    assert shard_texts(os.path.join(directory, "shard_00000.parquet"))[0] == "shard_00000.parquet doc 0"


def test_offline_download_says_what_to_do_and_leaves_nothing(monkeypatch):
    with socket.socket() as s:  # a port with nothing listening: connection refused, like a machine offline
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("NANOCHAT_HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(DatasetError, match="--builtin.*--from") as e:
        dataset.download_shards(1, base_delay=0.01, max_attempts=2)
    assert "shard_00000.parquet" in str(e.value)
    assert os.listdir(dataset.data_dir()) == []


def test_download_refuses_to_mix_with_an_imported_corpus(tmp_path, hub):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    dataset.import_corpus([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    with pytest.raises(DatasetError, match="another directory"):
        dataset.download_shards(1, base_delay=0.01)
    assert hub.requests == []


# -----------------------------------------------------------------------------
# --from

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
