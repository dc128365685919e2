"""dev/bench_serve.py at a tiny size against the real server: 503s from a full server are expected, nothing else."""

import argparse
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from dev import bench_serve
from tests.support.tiny_checkpoint import MODEL_TAG, tiny_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_tiny_load_run_reports_every_level_and_no_defect(tmp_path_factory):
    base_dir = tiny_checkpoint(tmp_path_factory)[0]
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
    # one slot and no queue: the 4 clients' requests beyond the first are 503s, which must not fail the run
    cmd = [sys.executable, "-m", "dev.bench_serve", "--model_tag", MODEL_TAG, "--concurrency", "1,4", "--requests",
           "8", "--max_tokens", "4", "--max_concurrency", "1", "--queue_timeout", "0", "--level_seconds", "30",
           "--n_sup", "all,rms:inf"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| 1 |")
            or line.startswith("| 4 |")]
    # each level once per depth and kind of connection, in turn; a token ran all 3 steps, or halted after the first
    # (rms:inf)
    assert [row[:4] for row in rows] == [[f"| {level}", kind, depth, steps] for level in (1, 4)
                                         for depth, steps in (("all", "3.00"), ("rms:inf", "1.00"))
                                         for kind in ("reused", "new")]
    for row in rows[:4]:  # one client: every request served, on kept-alive and on new connections alike
        assert row[5:7] == ["8", "8"] and row[-1] == "none |"
        assert float(row[8]) > 0 and float(row[11]) > 0 and float(row[13]) > 0  # tokens/s, TTFT, TPOT
    assert "503 server_busy" in rows[4][-1] and int(rows[4][6]) >= 1
    assert "server RSS: " in result.stdout and " MiB after the last" in result.stdout


def test_only_a_503_from_a_full_server_is_not_a_defect():
    results = [(None, 0.1, None, False, 8), (None, 0.3, 0.05, True, 11), ("503 server_busy", 0.01, None, False, 0),
               ("500 None", 0.2, None, False, 0), ("ReadTimeout", None, None, True, 0),
               ("broken stream", 0.1, 0.02, True, 3)]
    row, defects = bench_serve.summarize(4, results, seconds=2.0, rss=123.4)
    assert defects == {"500 None": 1, "ReadTimeout": 1, "broken stream": 1}
    # 19 tokens in 2 s; TPOT of the streamed one: (0.3 - 0.05) s over its 10 tokens after the first
    assert row.startswith("| 4 | 6 | 2 | 1.00 | 9.5 | 200 | 298 | 50 | 50 | 25.0 | 123 |")


def test_answer_bpb_through_the_server_is_the_models_own(tmp_path_factory, monkeypatch):
    base_dir, model, tokenizer = tiny_checkpoint(tmp_path_factory)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    ids = tokenizer.encode("the cat sat on the log. the dog sat on the mat. the cat", prepend="<|bos|>")
    windows, answer = [ids[:14], ids[3:17]], 5

    def expected(n_sup):  # the model's own log-probabilities, in process: nats of each window's last 5 tokens
        nats, n_bytes = 0.0, 0
        for w in windows:
            with torch.no_grad():
                lp = F.log_softmax(model(torch.tensor([w]), n_sup=n_sup)[0].float(), dim=-1)
            nats -= sum(lp[t - 1, w[t]].item() for t in range(len(w) - answer, len(w)))
            n_bytes += len(tokenizer.decode(w[-answer:]).encode())
        return nats / math.log(2) / n_bytes

    args = argparse.Namespace(max_concurrency=None, queue_timeout=None)
    with bench_serve.server(str(base_dir), MODEL_TAG, "key", args) as (_, url):
        got = {n: bench_serve.answer_bpb(url, "key", windows, answer, tokenizer, n) for n in (None, 1, "rms:inf")}
    assert math.isclose(got[None], expected(3), rel_tol=1e-4) and math.isclose(got[1], expected(1), rel_tol=1e-4)
    assert got[None] != got[1] and math.isclose(got["rms:inf"], got[1], rel_tol=1e-5)  # halted at step 1: step 1's


def test_the_heavy_mode_reports_the_short_clients_latency_beside_heavy_ones(tmp_path_factory, monkeypatch, capsys):
    """--heavy: heavy clients loop from 127.0.0.1, one short chat client from 127.0.0.2; the heavy body is clipped to
    the server's limits (the tiny model's context, 32 tokens). main in process (the server is still a process of its
    own): `python -m dev.bench_serve` is the levels test's."""
    base_dir = tiny_checkpoint(tmp_path_factory)[0]
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = bench_serve.main(["--model_tag", MODEL_TAG, "--heavy", "2", "--level_seconds", "2"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert '2 heavy clients from 127.0.0.1 loop {"prompt": "x", "max_tokens": 32, "n": 8, "n_sup": 8}' in out
    row = next(line for line in out.splitlines() if line.startswith("| 2 |")).split(" | ")
    assert int(row[1]) >= 1 and int(row[2]) >= 1 and row[3] == row[2]  # every short request served
    assert float(row[4]) > 0 and float(row[7]) > 0 and row[-1] == "none |"


def test_the_heavy_row_counts_every_client_and_only_unexpected_errors_are_defects():
    heavy = [(None, 5.0, 1024), (None, 6.0, 1000), ("503 server_busy", 30.0, 0)]
    short = [(None, 0.1, 4), (None, 0.3, 4), ("500 None", 0.2, 0)]
    row, defects = bench_serve.summarize_heavy(16, heavy, short, seconds=10.0)
    assert defects == {"500 None": 1}
    # 2 heavy served; 3 short sent, 2 served (p50 200 ms, p99 298 ms, max 300 ms); 2,032 tokens in 10 s
    assert row == "| 16 | 2 | 3 | 2 | 200 | 298 | 300 | 203.2 | 10.0 | 500 None: 1, 503 server_busy: 1 |"
