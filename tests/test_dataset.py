"""Shard download (against a fault-injecting local server), corpus import, and the built-in corpus."""

import hashlib
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset
from nanochat.dataset import DatasetError
from tests.conftest import stderr_capture


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
    """Serves parquet bytes by file name, honouring Range unless `ranges` is False; `faults[name]` lists failures to
    inject, one per request, before success. `requests` records (name, Range header) of every request."""

    def __init__(self, files):
        self.files, self.faults, self.requests, self.ranges = files, {}, [], True
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = os.path.basename(self.path)
                hub.requests.append((name, self.headers.get("Range")))
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
                start = int(self.headers["Range"][6:-1]) if hub.ranges and self.headers.get("Range") else 0
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                try:
                    if fault in ("trickle", "stall"):  # one byte every 0.1 s, or nothing at all, until cut off
                        for i in range(start, len(body)):
                            time.sleep(0.1 if fault == "trickle" else 60)
                            self.wfile.write(body[i:i + 1])
                            self.wfile.flush()
                    self.wfile.write(body[start:len(body) // 2] if fault == "short" else body[start:])
                except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def names(self):
        return [name for name, _ in self.requests]


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
    assert hub.names().count("shard_00002.parquet") == 2
    hub.requests.clear()
    dataset.download_shards(4, workers=2, base_delay=0.01)
    assert hub.requests == []  # everything was complete: nothing fetched again


def test_download_404_fails_at_once_naming_file_and_url(hub, capsys):
    hub.files.pop("shard_00001.parquet")
    assert dataset.main(["-n", "2", "-w", "2"]) == 1
    err = capsys.readouterr().err
    assert "shard_00001.parquet: HTTP 404" in err and f"{hub.url}/datasets/{dataset.REPO_ID}" in err
    assert hub.names().count("shard_00001.parquet") == 1  # permanent: not retried
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


def test_download_refuses_to_mix_with_an_imported_corpus_until_its_shards_are_removed(tmp_path, hub):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    dataset.import_corpus([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    with pytest.raises(DatasetError, match="remove its .parquet files, or set NANOCHAT_DATA_DIR"):
        dataset.download_shards(1, base_delay=0.01)
    assert hub.requests == []
    for path in dataset.list_parquet_files():  # what the message says, and nothing more: corpus.json stays
        os.remove(path)
    within(60, dataset.download_shards, 1, base_delay=0.01)
    assert dataset.read_source(dataset.data_dir()) == dataset.SOURCE_FINEWEB


def within(seconds, fn, *args, **kwargs):
    """fn's result (or exception); fails the test if fn runs past `seconds`, so a hang cannot stall the suite."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test thread below
            outcome["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def partial_files(directory):
    return [name for name in os.listdir(directory) if ".tmp" in name]


@pytest.mark.parametrize("server_honours_range", [True, False])
def test_a_cut_body_is_resumed_with_a_range_request(hub, server_honours_range):
    hub.ranges = server_honours_range
    hub.faults = {"shard_00000.parquet": ["short"]}
    within(60, dataset.download_shards, 1, base_delay=0.01)
    half = len(hub.files["shard_00000.parquet"]) // 2
    assert [r for r in hub.requests if r[0] == "shard_00000.parquet"] == [
        ("shard_00000.parquet", None), ("shard_00000.parquet", f"bytes={half}-")]
    path = os.path.join(dataset.data_dir(), "shard_00000.parquet")
    with open(path, "rb") as f:
        assert f.read() == hub.files["shard_00000.parquet"]  # whether the server resumed or sent it all again
    assert partial_files(dataset.data_dir()) == []


def test_a_trickling_server_meets_the_shard_deadline(hub):
    hub.faults = {"shard_00000.parquet": ["trickle"] * 10}
    t0 = time.monotonic()
    with pytest.raises(DatasetError, match=r"shard_00000.parquet: not complete after 1 s .*--shard_timeout"):
        within(30, dataset.download_shards, 1, base_delay=0.01, shard_timeout=1)
    assert time.monotonic() - t0 < 10
    assert partial_files(dataset.data_dir()) == []
    assert sorted(os.listdir(dataset.data_dir())) == ["corpus.json", "shard_01822.parquet"]  # the val shard came


def test_ctrl_c_stops_at_once_with_one_line_and_no_partial_file(hub, tmp_path):
    hub.faults = {"shard_00000.parquet": ["stall"], "shard_01822.parquet": ["stall"]}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nanochat.dataset", "-n", "1", "-w", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        give_up = time.monotonic() + 60
        while len(hub.requests) < 2 and time.monotonic() < give_up:  # both downloads in flight, stalled
            time.sleep(0.05)
        assert len(hub.requests) == 2
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=15)
        assert time.monotonic() - t0 < 5
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130
    assert err.strip().startswith("interrupted: ") and len(err.strip().splitlines()) == 1
    assert partial_files(dataset.data_dir()) == []


def test_partial_files_of_a_killed_download_are_removed_but_not_a_live_one(hub):
    import fcntl
    directory = dataset.data_dir()
    os.makedirs(directory)
    with open(os.path.join(directory, "shard_00000.parquet.tmp99999"), "wb") as f:
        f.write(b"PAR1 half a shard")  # its writer was killed: nobody holds its lock
    with open(os.path.join(directory, "shard_00001.parquet.tmp424242"), "wb") as live:
        fcntl.flock(live, fcntl.LOCK_EX)  # a download running now in another process holds its lock
        within(60, dataset.download_shards, 1, base_delay=0.01)
        assert partial_files(directory) == ["shard_00001.parquet.tmp424242"]
    assert shard_texts(os.path.join(directory, "shard_00000.parquet"))[0] == "shard_00000.parquet doc 0"


@pytest.mark.parametrize("endpoint", ["ftp://mirror.example", "hf-mirror.com", "http://"])
def test_an_endpoint_that_is_not_an_http_url_is_refused(endpoint, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_HF_ENDPOINT", endpoint)
    assert dataset.main(["-n", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: NANOCHAT_HF_ENDPOINT={endpoint!r} is not an http(s) URL; set it to a hub or mirror " \
                  "such as https://huggingface.co, or unset it"
    assert not os.path.exists(dataset.data_dir())


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
# progress bars: rank 0, on a terminal only

@pytest.mark.parametrize("terminal, rank, shown", [(True, 0, True), (False, 0, False), (True, 1, False)])
def test_progress_shows_on_rank_0_of_a_terminal_only(terminal, rank, shown, hub, corpus_files, tmp_path, monkeypatch):
    if rank:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
    stderr = stderr_capture(monkeypatch, terminal)
    dataset.import_corpus([str(corpus_files)])
    assert ("Generating train split" in stderr.getvalue()) == shown  # datasets' own bar
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "download"))
    dataset.download_shards(1, base_delay=0.01)
    assert ("files: 100%" in stderr.getvalue()) == shown
