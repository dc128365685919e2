"""Tests for /v1/refinement (nanochat/serve/refinement.py behind scripts/serve.py): every number checked against the
model's own forward at each depth, or against base_sample --show_steps."""

import ast
import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from nanochat.data.dataset import SYNTHETIC, synthetic_flags, write_source
from nanochat.data.synthetic import HopsSpec, hops_answers, hops_document, pairs_document
from nanochat.model.engine import Engine
from nanochat.model.halting import Halting, forward_halting
from nanochat.serve import refinement
from nanochat.serve.server import Server, create_app
from nanochat.serve.streaming import Worker
from scripts import base_sample
from tests.support.server import serving
from tests.support.tiny_checkpoint import MODEL_TAG, tiny_checkpoint

KEY = "sk-refinement-test"
LOCAL = "http://localhost"  # TestClient's default Host, testserver, is no name of a server listening on loopback
ATOL = 1e-4  # float32 reorderings between a cached decode and a full forward move probabilities by ~1e-6


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(trained):
    _, model, tokenizer = trained
    return Server(Engine(model, tokenizer), {"model_tag": MODEL_TAG, "step": 40}, queue_timeout=0)


@pytest.fixture(scope="module")
def client(server):
    with TestClient(create_app(server), base_url=LOCAL, raise_server_exceptions=True) as c:
        yield c


def refine(client, **body):
    r = client.post("/v1/refinement", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def depth_probs(model, ids, n_sup):
    """(T, V) next-token probabilities of a plain forward at depth n_sup: what step n_sup of any deeper run computes."""
    with torch.no_grad():
        return F.softmax(model(torch.tensor([ids]), n_sup=n_sup)[0].float(), dim=-1)


def test_tokens_and_drafts_equal_base_sample_show_steps_for_the_same_seed(trained, client, monkeypatch, capsys):
    base_dir, model, tokenizer = trained
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    prompt, n_sup = "the dog", model.config.n_sup_inference
    assert base_sample.main(["--model_tag", MODEL_TAG, "--prompt", prompt, "--max_tokens", "8", "--temperature", "1.5",
                             "--seed", "5", "--show_steps", "--device_type", "cpu"]) == 0
    section = capsys.readouterr().out.split(f"--- {prompt!r}\n")[1]
    completion = section.split("\n")[0].removeprefix(prompt)
    drafts = [ast.literal_eval(section.split(f"step {s}/{n_sup} (greedy): ")[1].split("\n")[0])
              for s in range(1, n_sup + 1)]
    got = refine(client, prompt=prompt, max_tokens=8, temperature=1.5, top_k=50, seed=5, drafts=True)
    assert got["text"] == completion and "".join(t["text"] for t in got["tokens"]) == completion
    assert got["drafts"] == drafts
    # each step's row is its greedy token given the final answer's prefix: the step's own draft, while that prefix
    # is the draft's (up to and including the first token where the final answer leaves it)
    final = [t["id"] for t in got["tokens"]]
    for s in range(1, n_sup + 1):
        draft = Engine(model, tokenizer).generate_batch([tokenizer.encode(prompt, prepend="<|bos|>")], n_sup=s,
                                                        max_tokens=8, temperature=0.0)[0]
        k = 0
        while k < min(len(draft), len(final)) and (k == 0 or draft[k - 1] == final[k - 1]):
            assert got["tokens"][k]["steps"][s - 1]["id"] == draft[k], (s, k)
            k += 1
        assert k >= 1


@pytest.mark.parametrize("halt, n_sup", [(None, None), ("rms:0.05", None), ("rms:0.05", 1), ("kl:0.001", 1)])
def test_each_steps_token_and_probabilities_are_that_depths_forward(trained, client, halt, n_sup):
    _, model, tokenizer = trained
    got = refine(client, prompt="the cat", max_tokens=6, temperature=1.0, seed=11, halt=halt, n_sup=n_sup)
    ids = tokenizer.encode("the cat", prepend="<|bos|>") + [t["id"] for t in got["tokens"]]
    start = len(ids) - len(got["tokens"]) - 1  # the position that predicts the first generated token
    assert got["n_sup"] == (n_sup or model.config.n_sup_inference)
    assert all(len(token["steps"]) == got["n_sup"] for token in got["tokens"])
    for s in range(1, got["n_sup"] + 1):
        probs = depth_probs(model, ids, s)
        for k, token in enumerate(got["tokens"]):
            step, p = token["steps"][s - 1], probs[start + k]
            assert step["id"] == p.argmax().item() and step["text"] == tokenizer.decode([step["id"]])
            assert step["prob"] == pytest.approx(p.max().item(), abs=ATOL)
            assert step["chosen_prob"] == pytest.approx(p[token["id"]].item(), abs=ATOL)


def test_greedy_final_step_agrees_with_the_answer(client, trained):
    got = refine(client, prompt="the mat", max_tokens=5, temperature=0)
    assert len(got["tokens"]) == 5 and got["finish_reason"] == "length"
    for token in got["tokens"]:
        last = token["steps"][-1]
        assert last["id"] == token["id"] and last["prob"] == last["chosen_prob"]


@pytest.mark.parametrize("rule", ["rms:0.05", "kl:0.0001"])
def test_halt_step_is_where_the_rule_halts_that_position(trained, client, rule):
    _, model, tokenizer = trained
    got = refine(client, prompt="the log. the cat", max_tokens=10, temperature=1.0, seed=2, halt=rule)
    ids = tokenizer.encode("the log. the cat", prepend="<|bos|>") + [t["id"] for t in got["tokens"]]
    _, steps = forward_halting(model, torch.tensor([ids[:-1]]), Halting.parse(rule), None)
    want = steps[0, len(ids) - 1 - len(got["tokens"]):].tolist()
    assert [t["halt_step"] for t in got["tokens"]] == want and len(set(want)) > 1  # the colours vary
    assert got["mean_halt_steps"] == pytest.approx(sum(want) / len(want)) and got["halt"] == rule


def test_streamed_events_are_the_tokens_then_the_summary(client, server):
    body = dict(prompt="the dog sat", max_tokens=4, temperature=0.7, seed=3)
    whole = refine(client, **body)
    with client.stream("POST", "/v1/refinement", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert events[:-1] == whole["tokens"]
    summary = {k: v for k, v in whole.items() if k != "tokens"}
    assert events[-1] == {**summary, "object": "refinement.done"} and server.running == 0


def test_score_gives_each_tokens_loss_at_every_depth(trained, client):
    _, model, tokenizer = trained
    text = "the dog sat on the log. the cat"
    got = refine(client, mode="score", text=text)
    ids = tokenizer.encode(text, prepend="<|bos|>")
    assert got["tokens"] == [tokenizer.decode([t]) for t in ids[1:]]
    for s in range(1, model.config.n_sup_inference + 1):
        probs = depth_probs(model, ids[:-1], s)
        want = [-probs[t, ids[t + 1]].log().item() for t in range(len(ids) - 1)]
        assert got["losses"][s - 1] == pytest.approx(want, abs=ATOL, rel=1e-4)
        assert got["mean_loss"][s - 1] == pytest.approx(sum(want) / len(want), abs=ATOL)


def test_hops_marks_each_querys_answer_at_every_step(trained, client):
    _, model, tokenizer = trained
    text = "a>b b>c c>a ; a1=b c2=b b3=b"
    got = refine(client, mode="hops", text=text, n_sup=2)
    assert [(q["offset"], q["hops"], q["answer"]) for q in got["queries"]] == [(17, 1, "b"), (22, 2, "b"), (27, 3, "b")]
    pieces = [tokenizer.encode(text[:17], prepend="<|bos|>"), tokenizer.encode("b"), tokenizer.encode(text[18:22]),
              tokenizer.encode("b"), tokenizer.encode(text[23:27]), tokenizer.encode("b")]  # as hops_eval encodes
    ids = [t for piece in pieces for t in piece]
    answer_at = [len([t for piece in pieces[:i] for t in piece]) for i in (1, 3, 5)]
    for s in (1, 2):
        probs = depth_probs(model, ids[:-1], s)
        for q, at in zip(got["queries"], answer_at):
            p = probs[at - 1]
            step = q["steps"][s - 1]
            assert step["text"] == tokenizer.decode([p.argmax().item()])
            assert step["correct"] == (p.argmax().item() == ids[at])
            assert step["prob"] == pytest.approx(p[ids[at]].item(), abs=ATOL)
        assert got["accuracy"][s - 1] == [float(q["steps"][s - 1]["correct"]) for q in got["queries"]]
    assert got["hops"] == [1, 2, 3]


def test_hops_draws_the_document_of_a_seed(trained, server, monkeypatch):
    _, model, _ = trained
    monkeypatch.setattr(model.config, "sequence_len", 128)  # a drawn table of 16 symbols outgrows the tiny context
    drawn = hops_document(random.Random(4), HopsSpec(n_queries=2))
    got = refine(TestClient(create_app(server), base_url=LOCAL), mode="hops", seed=4, n_queries=2)
    assert got["text"] == drawn and len(got["queries"]) == 2


def test_the_corpus_a_checkpoint_was_trained_on_is_read_back_from_its_data_directory(tmp_path, monkeypatch):
    spec = HopsSpec(n_symbols=7, max_hops=3, n_queries=24)
    trained_on, current, text = tmp_path / "trained_on", tmp_path / "current", tmp_path / "text"
    for directory in (trained_on, current, text):
        directory.mkdir()
    write_source(str(trained_on), f"{SYNTHETIC} {synthetic_flags('hops_pairs', 0, 60000, spec)}")
    write_source(str(text), "builtin: Python 3.11 standard library")
    want = refinement.HopsCorpus("hops_pairs", spec, f"{SYNTHETIC} {synthetic_flags('hops_pairs', 0, 60000, spec)}")
    assert refinement.trained_hops_corpus({"data": {"dir": str(trained_on), "fingerprint": "f"}}) == want
    assert want.draw(5) == pairs_document(random.Random(5), spec) and len(want.draw(5, n_queries=2)) == 7 + 3 + 7
    # the recorded directory is gone; the current one (NANOCHAT_DATA_DIR) holds the same shards: read from it
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(current))
    write_source(str(current), want.source)
    monkeypatch.setattr("nanochat.data.dataset.corpus_identity", lambda directory=None: {"fingerprint": "f"})
    assert refinement.trained_hops_corpus({"data": {"dir": str(tmp_path / "gone"), "fingerprint": "f"}}) == want
    assert refinement.trained_hops_corpus({"data": {"dir": str(tmp_path / "gone"), "fingerprint": "g"}}) is None
    assert refinement.trained_hops_corpus({"data": {"dir": str(text), "fingerprint": "g"}}) is None  # not hops
    assert refinement.trained_hops_corpus({}) is None  # a checkpoint from before data was recorded
    assert refinement.hops_corpus_of("synthetic: --synthetic=other --hops_symbols=3") is None


def test_every_mode_runs_up_to_four_times_the_trained_steps(trained, client):
    _, model, _ = trained
    most = 4 * model.config.n_sup_train
    assert client.get("/health").json()["n_sup_max"] == most
    scored = refine(client, mode="score", text="the cat sat", n_sup=most)
    ids = trained[2].encode("the cat sat", prepend="<|bos|>")
    with torch.no_grad():
        losses = model(torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]), n_sup=most, loss_reduction="none")
    assert torch.allclose(torch.tensor(scored["losses"]), losses[:, 0], atol=ATOL) and len(scored["losses"]) == most
    got = refine(client, prompt="the", max_tokens=3, temperature=0, n_sup=most, drafts=True)
    assert len(got["drafts"]) == most and all(len(t["steps"]) == most for t in got["tokens"])


@pytest.mark.parametrize("body, param, message", [
    ([1], None, "the body must be a JSON object"),
    ({"mode": "chat", "prompt": "x"}, "mode", "mode: one of generate, score, hops"),
    ({"prompt": "x", "text": "y"}, "text", "text: unknown field; the fields are mode, prompt, messages, max_tokens,"),
    ({"prompt": 5}, "prompt", "prompt: Input should be a valid string"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"mode": "score"}, "text", "text: Field required"),
    ({"prompt": ""}, "prompt", "prompt: a non-empty string is required"),
    ({"prompt": "x", "n_sup": 13}, "n_sup", "n_sup=13: must be from 1 to 12 (4x the 3 supervision steps the model"),
    ({"mode": "score", "text": "the cat", "n_sup": 0}, "n_sup", "n_sup=0: must be from 1 to 12"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens=0: must be from 1 to 32"),
    ({"prompt": "x", "temperature": 3}, "temperature", "temperature=3.0: must be from 0 to 2"),
    ({"prompt": "x", "halt": "kl"}, "halt", "halt: halting rule 'kl': write RULE:THRESHOLD"),
    ({"prompt": "x", "halt": "head:0.5"}, "halt", "halt: halting rule head:0.5: this model has no halting head"),
    ({"prompt": "the cat " * 20}, "prompt", "tokens (with <|bos|>); the model's context is 32 tokens"),
    ({"mode": "score", "text": "the", "prompt": "x"}, "prompt", "prompt: unknown field; the fields are mode, text"),
    ({"mode": "hops", "text": "a>b ; a1=b", "seed": 1}, "text", "hops: send text (a hops document) or seed"),
    ({"mode": "hops", "text": "no queries"}, "text", "a document holds no hops query"),
    ({"mode": "hops", "text": "1="}, "text", "the text ends with '=': write each query's answer after it"),
    ({"mode": "hops", "text": "a>b ; x=y"}, "text", "the '=' at character 8 (' x=y') must follow a hop count digit"),
    ({"mode": "hops", "text": "=a b1=a"}, "text", "the '=' at character 1 ('=a') must follow a hop count digit"),
    ({"mode": "hops", "text": "a>b ; a\u00b2=b"}, "text", "must follow a hop count digit 0-9"),  # '²'.isdigit()
    ({"mode": "hops", "seed": 1, "n_queries": -1}, "n_queries", "n_queries: n_queries=-1: must be >= 1"),
    ({"mode": "hops", "seed": 1, "n_queries": 0}, "n_queries", "n_queries: n_queries=0: must be >= 1"),  # not 24
    ({"mode": "hops", "seed": -1}, "seed", "seed=-1: must be from 0 to 2**63-1"),
    ({"mode": "hops", "seed": 1, "n_queries": 10 ** 9}, "n_queries", "n_queries=1000000000: at most 32"),
    ('{"prompt": "x", "temperature": NaN}', "temperature", "temperature=nan: must be from 0 to 2"),  # Python's JSON
])
def test_a_bad_request_is_one_400_naming_the_field(client, body, param, message):
    raw = isinstance(body, str)  # sent as written: json= would refuse NaN
    r = client.post("/v1/refinement", content=body if raw else None, json=None if raw else body,
                    headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and message in error["message"] and error["param"] == param, error


SMALL_HOPS = "a>b b>c c>a ; a1=b c2=b"  # fits the tiny model's context
EDITS = st.lists(st.tuples(st.integers(0, len(SMALL_HOPS)), st.integers(0, 2),
                           st.sampled_from(["", "=", "=", "1", "0", "a", ">", ";", " ", "\u00b2", "\u0663", "\n"])),
                 max_size=4)


def edited(text, edits):
    """text with each (at, cut, insert) applied: cut characters at `at` replaced by insert."""
    for at, cut, insert in edits:
        text = text[:at] + insert + text[at + cut:]
    return text


HOPS_TEXTS = st.one_of(st.builds(edited, st.just(SMALL_HOPS), EDITS), st.text("abz>=; 019\u00b2\n", max_size=30),
                       st.text(max_size=30))


@settings(max_examples=150, deadline=None)
@given(text=HOPS_TEXTS)
@example(text="1=")  # were a 500 (an IndexError), or Python's int() message
@example(text="a>b ; x=y")
@example(text="=a")
def test_no_hops_text_gets_a_500(client, text):
    r = client.post("/v1/refinement", json={"mode": "hops", "text": text, "n_sup": 1})
    event(f"status {r.status_code}")  # --hypothesis-show-statistics: how many were answered
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["param"] == "text" and error["message"] and "\n" not in error["message"], error
    else:
        got = r.json()
        assert [q["offset"] for q in got["queries"]] == [a.position for a in hops_answers(text)]


def test_a_hops_text_error_is_counted_in_metrics(client):
    def refused():
        line = 'nanochat_requests_total{route="/v1/refinement",status="400"} '
        return next((float(x[len(line):]) for x in client.get("/metrics").text.splitlines() if x.startswith(line)), 0)

    before = refused()
    assert client.post("/v1/refinement", json={"mode": "hops", "text": "1="}).status_code == 400
    assert refused() == before + 1


def test_a_wrong_or_missing_key_is_a_401_but_the_page_needs_none(server):
    client = TestClient(create_app(server, api_key=KEY), base_url=LOCAL)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = client.post("/v1/refinement", json={"prompt": "the"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.post("/v1/refinement", json={"prompt": "the", "max_tokens": 1},
                       headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert KEY not in page.text


def test_a_client_that_leaves_mid_stream_stops_the_generation_and_frees_the_slot(trained, monkeypatch):
    _, model, tokenizer = trained
    server = Server(Engine(model, tokenizer), {"model_tag": MODEL_TAG, "step": 40}, queue_timeout=0)
    made, real = [], refinement.generate

    def slow(engine, req):  # a token every 50 ms: the client leaves long before the 32nd
        for item in real(engine, req):
            made.append(item)
            time.sleep(0.05)
            yield item

    monkeypatch.setattr(refinement, "generate", slow)
    body = {"prompt": "the", "max_tokens": 32, "temperature": 1.0, "stream": True}
    with serving(create_app(server)) as url:
        with httpx.stream("POST", f"{url}/v1/refinement", json=body, timeout=30) as r:
            lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
            first = next(lines)
            busy = httpx.post(f"{url}/v1/refinement", json={"prompt": "the"}, timeout=30)
        # the block's end closed the connection mid-stream: the client left
        assert first.startswith('data: {"object": "refinement.token"')
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
        deadline = time.monotonic() + 10
        while server.running:
            assert time.monotonic() < deadline, "the slot was never freed"
            time.sleep(0.02)
        assert len(made) < 32
        served = httpx.post(f"{url}/v1/refinement", json={"prompt": "the", "max_tokens": 1}, timeout=30)
        assert served.status_code == 200


def test_a_client_that_leaves_before_the_answer_frees_the_slot_at_once(trained, monkeypatch):
    """Not streamed: a generation of 32 tokens at 100 ms each whose client gives up after 0.5 s stops within a token
    or two and frees its slot, as /v1/completions does; /metrics counts it as 499 (client closed request)."""
    _, model, tokenizer = trained
    server = Server(Engine(model, tokenizer), {"model_tag": MODEL_TAG, "step": 40}, queue_timeout=0)
    made, real = [], refinement.generate

    def slow(engine, req):
        for item in real(engine, req):
            made.append(item)
            time.sleep(0.1)
            yield item

    monkeypatch.setattr(refinement, "generate", slow)
    with serving(create_app(server)) as url:
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/refinement", json={"prompt": "the", "max_tokens": 32, "temperature": 1.0},
                       timeout=0.5)
        while server.running:
            assert time.monotonic() - start < 2, "the slot was not freed when the client left"
            time.sleep(0.02)
        assert len(made) < 32
        served = httpx.post(f"{url}/v1/refinement", json={"prompt": "the", "max_tokens": 1}, timeout=30)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert served.status_code == 200
    assert 'nanochat_requests_total{route="/v1/refinement",status="499"} 1.0' in metrics


def items_work(made, count, gate=None):
    """A streaming.Worker's work emitting 0, 1, ... count-1 (each after the last was taken by the loop, if gate)."""
    def work(emit, cancelled):
        for i in range(count):
            made.append(i)
            emit(i)
            if gate is not None:
                gate.wait(timeout=10)  # the next item waits until the consumer has left
            if cancelled.is_set():
                return
    return work


def test_the_worker_ends_and_releases_even_when_no_one_reads_its_items():
    released, made = [], []

    async def never_read():
        done = asyncio.Event()
        Worker(items_work(made, 3), [lambda worker: (released.append(True), done.set())])
        await asyncio.wait_for(done.wait(), timeout=10)

    asyncio.run(never_read())
    assert released == [True] and made == [0, 1, 2]


def test_a_consumer_that_stops_early_stops_the_worker():
    released, made, gate = [], [], threading.Event()

    async def read_one():
        done = asyncio.Event()
        worker = Worker(items_work(made, 1000, gate), [lambda worker: (released.append(True), done.set())])
        batches = worker.batches()
        assert await anext(batches) == ([0], False)
        await batches.aclose()
        gate.set()
        await asyncio.wait_for(done.wait(), timeout=10)

    asyncio.run(read_one())
    assert released == [True] and len(made) <= 2


def test_a_generation_that_fails_mid_stream_ends_with_an_error_event(client, server, monkeypatch):
    real = refinement.generate

    def fails_after_one(engine, req):
        events = real(engine, req)
        yield next(events)
        raise RuntimeError("out of memory")

    monkeypatch.setattr(refinement, "generate", fails_after_one)
    with client.stream("POST", "/v1/refinement", json={"prompt": "the", "max_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert len(lines) == 2 and json.loads(lines[0].removeprefix("data: "))["object"] == "refinement.token"
    assert json.loads(lines[1].removeprefix("data: ")) == {
        "error": {"message": "generation failed: out of memory", "type": "server_error"}}
    assert server.running == 0
