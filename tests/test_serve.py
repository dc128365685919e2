"""Tests for the HTTP server, over a real socket on 127.0.0.1, serving a tiny trained checkpoint."""

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from nanochat.engine import Engine
from scripts import serve
from tests.tiny_checkpoint import MODEL_TAG, tiny_checkpoint



@contextlib.contextmanager
def running(http):
    """Run a uvicorn.Server in a thread on a socket bound to a free port; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not http.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def url(trained):
    base_dir, _, _ = trained
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base_dir))
        args = serve.parse_args(["--model_tag", MODEL_TAG, "--step", "latest", "--max_concurrency", "2",
                                 "--device_type", "cpu", "--port", "0"])
        http, _ = serve.build_server(args)
    with running(http) as base_url:
        yield base_url


def post(url, body, **kwargs):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"},
                      timeout=30, **kwargs)


def test_health(url, trained):
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200
    health = r.json()
    assert health["status"] == "ok" and health["model_tag"] == MODEL_TAG and health["step"] == 40
    assert health["n_sup_max"] == trained[1].config.n_sup_inference and health["max_concurrency"] == 2


def test_completion_matches_the_engine(url, trained):
    _, model, tokenizer = trained
    r = post(url, {"prompt": "the cat sat", "max_tokens": 10, "temperature": 0.0, "n_sup": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = Engine(model, tokenizer).complete(["the cat sat"], max_tokens=10, temperature=0.0, n_sup=2)[0]
    assert body["completion"] == expected and expected.startswith(" on the")
    assert body["n_sup"] == 2 and body["completion_tokens"] == 10 and body["finish_reason"] == "length"
    assert body["prompt_tokens"] == len(tokenizer.encode("the cat sat")) + 1  # with <|bos|>


def test_seeded_sampling_over_http_is_reproducible(url):
    request = {"prompt": "the", "max_tokens": 12, "temperature": 1.5, "top_k": 50, "seed": 3}
    first = post(url, request).json()["completion"]
    assert post(url, request).json()["completion"] == first
    assert post(url, {**request, "seed": 4}).json()["completion"] != first


def read_events(response):
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_streaming(url):
    request = {"prompt": "the dog sat", "max_tokens": 10, "temperature": 0.0}
    with httpx.stream("POST", f"{url}/v1/completions", json={**request, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = read_events(r)
    assert events[-1] == "[DONE]"
    pieces = [json.loads(e)["text"] for e in events[:-2]]
    summary = json.loads(events[-2])
    assert len(pieces) > 1 and "".join(pieces) == post(url, request).json()["completion"]
    assert summary["completion_tokens"] == 10 and summary["finish_reason"] == "length"


BAD_REQUESTS = [
    (b'\xff\xfe{"prompt": "the"}', 400, "not valid UTF-8"),
    (b'{"prompt": "the"', 400, "not valid JSON"),
    (b"x" * (serve.MAX_BODY_BYTES + 1), 413, "exceeds"),
    ({"prompt": "the cat " * 40}, 422, "the model's context is 32 tokens"),
    ({"prompt": "the", "max_tokens": 10 ** 12}, 422, "exceeds this server's limit"),
    ({"prompt": "the", "max_tokens": 0}, 422, "max_tokens"),
    ({"prompt": "the", "temperature": -1}, 422, "temperature: Input should be greater than or equal to 0"),
    (b'{"prompt": "the", "temperature": NaN}', 422, "temperature: Input should be a finite number"),
    ({"prompt": "the", "n_sup": 99}, 422, "n_sup=99"),
    ({"prompt": "the", "top_k": 0}, 422, "top_k"),
    ({"prompt": "the", "max_tokens": "5"}, 422, "max_tokens: Input should be a valid integer"),
    ({"prompt": 5}, 422, "prompt: Input should be a valid string"),
    ({"prompt": "the", "temprature": 0.5}, 422, "temprature: Extra inputs are not permitted"),
    ([1, 2], 422, "valid dictionary"),
]


@pytest.mark.parametrize("body,status,message", BAD_REQUESTS, ids=[m for _, _, m in BAD_REQUESTS])
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(url, body, status, message):
    r = post(url, body)
    assert r.status_code == status, r.text
    assert message in r.json()["detail"]
    assert post(url, {"prompt": "the", "max_tokens": 2}).status_code == 200
    assert httpx.get(f"{url}/health").json()["running"] == 0  # a rejected request holds no slot


class HeldEngine(Engine):
    """Waits for the test's go-ahead after `free` tokens, so a generation holds its slot as long as the test wants."""

    def __init__(self, model, tokenizer, free=0):
        super().__init__(model, tokenizer)
        self.go, self.free = threading.Event(), free

    def generate(self, *args, **kwargs):
        columns = super().generate(*args, **kwargs)
        for i, column in enumerate(columns):
            assert i < self.free or self.go.wait(timeout=10)
            yield column


def held_server(trained, free=0):
    _, model, tokenizer = trained
    engine = HeldEngine(model, tokenizer, free)
    server = serve.Server(engine, {"model_tag": MODEL_TAG, "step": 40}, max_concurrency=1, queue_timeout=0.2)
    return engine, uvicorn.Server(uvicorn.Config(serve.create_app(server), log_level="warning"))


def wait_until_running(base_url, n):
    deadline = time.monotonic() + 10
    while httpx.get(f"{base_url}/health").json()["running"] != n:  # health answers while a generation runs
        assert time.monotonic() < deadline, f"running never became {n}"
        time.sleep(0.01)


def test_concurrency_is_bounded_and_health_stays_responsive(trained):
    engine, http = held_server(trained)
    request = {"prompt": "the", "max_tokens": 3, "temperature": 0.0}
    with running(http) as base_url:
        held = {}
        worker = threading.Thread(target=lambda: held.update(r=post(base_url, request)))
        worker.start()
        wait_until_running(base_url, 1)
        busy = post(base_url, request)
        assert busy.status_code == 503 and "server busy" in busy.json()["detail"]
        engine.go.set()
        worker.join(timeout=10)
        assert held["r"].status_code == 200
        assert post(base_url, request).status_code == 200  # the slot came back


def test_a_client_that_leaves_mid_stream_frees_its_slot(trained):
    engine, http = held_server(trained, free=1)
    request = {"prompt": "the", "max_tokens": 6, "temperature": 0.0, "stream": True}
    with running(http) as base_url:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=request, timeout=30) as r:
            assert next(r.iter_lines()).startswith("data: ")  # the first token came; the rest wait on the test
        engine.go.set()
        wait_until_running(base_url, 0)
        assert post(base_url, {**request, "stream": False}).status_code == 200


def test_serve_main_reports_a_missing_checkpoint(trained, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(trained[0]))
    assert serve.main(["--model_tag", "missing", "--device_type", "cpu"]) == 2
    assert "no checkpoint found for model tag 'missing'" in capsys.readouterr().err
