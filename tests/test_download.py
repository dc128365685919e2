"""nanochat/data/download.py through `nanochat.dataset -n`: shard download against a fault-injecting local server."""

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat.data import dataset
from nanochat.data.dataset import DatasetError
from tests.support.helpers import shard_texts, stderr_capture

pytestmark = pytest.mark.usefixtures("isolated_dirs")


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
    # as from a terminal: a suite started in the background (`&`) ignores SIGINT, and its children would inherit that
    proc = subprocess.Popen([sys.executable, "-m", "nanochat.data.dataset", "-n", "1", "-w", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
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
