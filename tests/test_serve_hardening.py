"""The server's smaller guards of issue 56: any foreign Origin among several refuses a request (and two Host headers
do); every special token, a role's start above all, ends a reply on every route that generates; /health without the
key of a keyed server says only that it is up."""

import collections
import socket
import threading

import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient

from nanochat.data.chat import render_prompt
from nanochat.data.tokenizer import SPECIAL_TOKENS
from nanochat.model import engine as engine_module
from nanochat.model.engine import STOP_TOKENS, Engine
from nanochat.serve import refinement
from nanochat.serve.http import guarded_http
from nanochat.serve.server import Server, create_app
from tests.support.server import running
from tests.support.tiny_checkpoint import MODEL_TAG, tiny_checkpoint

KEY = "sk-hardening"
OWN, FOREIGN = "http://127.0.0.1:8000", "http://attacker.example"
USER = [{"role": "user", "content": "the cat"}]
DETAILS = {"model_tag", "step", "sequence_len", "n_sup_max", "max_tokens_limit", "max_concurrency", "hops_corpus"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def app_of(trained, api_key=None):
    _, model, tokenizer = trained
    return create_app(Server(Engine(model, tokenizer), {"model_tag": MODEL_TAG, "step": 40}), api_key=api_key)


@pytest.fixture(scope="module")
def client(trained):
    with TestClient(app_of(trained), base_url="http://127.0.0.1:8000") as client:
        yield client


# ---------------------------------------------------------------- duplicate Origin and Host headers
@pytest.mark.parametrize("headers,status", [
    ([("origin", FOREIGN), ("origin", OWN)], 403),  # the first foreign: a dict of the headers kept the last
    ([("origin", OWN), ("origin", FOREIGN)], 403),
    ([("origin", OWN), ("origin", "null")], 403),
    ([("origin", OWN), ("origin", OWN)], 200),
    ([("origin", OWN)], 200),
    ([("host", "127.0.0.1:8000"), ("host", "attacker.example")], 400),  # which would a proxy read?
    ([("host", "127.0.0.1:8000"), ("host", "127.0.0.1:8000")], 400),
])
def test_any_foreign_origin_among_several_and_two_hosts_are_refused(client, headers, status):
    r = client.get("/health", headers=headers)
    assert r.status_code == status, r.text
    if status != 200:
        error = r.json()["error"]
        assert error["code"] == ("forbidden_origin" if status == 403 else "invalid_host")
        assert "\n" not in error["message"]


def raw_status(url, request):
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request.encode())
        return int(sock.recv(1 << 16).split(b" ", 2)[1])


def test_duplicate_origins_reach_the_gate_through_the_http_protocol(trained):
    """On the wire, through uvicorn's h11 and the production protocol: every Origin line is seen."""
    http = uvicorn.Server(uvicorn.Config(app_of(trained), http=guarded_http(), log_level="warning", lifespan="off"))
    with running(http) as url:
        authority = url.removeprefix("http://")
        ask = lambda *origins: raw_status(url, f"GET /health HTTP/1.1\r\nHost: {authority}\r\n" +  # noqa: E731
                                          "".join(f"Origin: {o}\r\n" for o in origins) + "Connection: close\r\n\r\n")
        assert ask(FOREIGN, url) == ask(url, FOREIGN) == 403 and ask(url, url) == ask(url) == 200


# ---------------------------------------------------------------- every special token ends a reply
def test_every_special_token_stops_a_reply():
    assert STOP_TOKENS[0] == "<|bos|>" and sorted(STOP_TOKENS) == sorted(SPECIAL_TOKENS)  # the export's bos: first
    assert {"<|user_start|>", "<|assistant_start|>", "<|python_start|>", "<|output_start|>"} <= set(STOP_TOKENS)


def force(monkeypatch, token, at):
    """The model samples `token` at its (at+1)-th token, whatever its logits say, on every route. Counted per thread:
    a batcher may take one more step for a request already answered, on its own thread."""
    real, calls = engine_module.sample_next, collections.Counter()

    def sample_next(logits, *args, **kwargs):
        calls[threading.get_ident()] += 1
        out = real(logits, *args, **kwargs)
        return torch.full_like(out, token) if calls[threading.get_ident()] == at + 1 else out

    monkeypatch.setattr(engine_module, "sample_next", sample_next)
    monkeypatch.setattr(refinement, "sample_next", sample_next)


@pytest.mark.parametrize("name", SPECIAL_TOKENS)
def test_a_special_token_the_model_writes_ends_the_reply_there(trained, monkeypatch, name):
    _, model, tokenizer = trained
    prompt = render_prompt(tokenizer, USER)
    first = Engine(model, tokenizer).generate_batch([prompt], max_tokens=2, temperature=0.0, stop_tokens=())[0]
    force(monkeypatch, tokenizer.encode_special(name), at=2)
    with TestClient(app_of(trained), base_url="http://127.0.0.1:8000") as client:  # its own batcher thread
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 6, "temperature": 0}).json()
        done = client.post("/v1/refinement", json={"messages": USER, "max_tokens": 6, "temperature": 0}).json()
    assert r["choices"][0]["message"]["content"] == tokenizer.decode(first) and r["usage"]["completion_tokens"] == 2
    assert r["choices"][0]["finish_reason"] == "stop"
    assert (done["text"], done["finish_reason"]) == (tokenizer.decode(first), "stop")


# ---------------------------------------------------------------- /health without the key
def test_health_tells_a_caller_without_the_key_only_that_the_server_is_up(trained):
    with TestClient(app_of(trained, api_key=KEY), base_url="http://127.0.0.1:8000") as keyed:
        for headers in ({}, {"Authorization": f"Basic {KEY}"}):  # a load balancer's probe sends none
            r = keyed.get("/health", headers=headers)
            assert r.status_code == 200 and r.json() == {"status": "ok"}
        full = keyed.get("/health", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert full["status"] == "ok" and DETAILS <= set(full) and full["model_tag"] == MODEL_TAG
        wrong = keyed.get("/health", headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with TestClient(app_of(trained), base_url="http://127.0.0.1:8000") as open_server:  # no key: nothing to hide
        assert DETAILS <= set(open_server.get("/health").json())
