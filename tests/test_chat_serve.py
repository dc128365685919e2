"""POST /v1/chat/completions with the official openai client against a real server on 127.0.0.1 (the tiny model): the
conversation rendered as chat_sft trains on it and answered as the engine answers it, streaming or not, with n_sup,
halting and each step's drafts (variations in-process); its errors; the same batching, slots and key as completions;
chat_eval through lm-eval's chat backend against it; and the viewer's Chat tab in headless Chromium."""

import json
import threading

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from nanochat.data.chat import render_prompt
from nanochat.model.engine import Engine
from nanochat.serve import refinement
from nanochat.serve import server as server_module
from nanochat.serve.api import AUTO_HALTING
from nanochat.serve.batcher import Batcher
from nanochat.serve.server import Server, create_app
from tests.support import server as support_server
from tests.support.chromium import Chromium, find_chromium
from tests.support.tiny_checkpoint import MODEL_TAG, tiny_checkpoint

KEY = "sk-chat-test"
USER = [{"role": "user", "content": "cat sat on the"}]  # a prompt whose answer changes from step 1 to 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def url(trained):
    _, model, tokenizer = trained
    server = Server(Engine(model, tokenizer), {"model_tag": MODEL_TAG, "step": 40}, max_concurrency=4)
    with support_server.serving(create_app(server)) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def answer(trained, messages, max_tokens, **kwargs):
    """What the engine replies, greedily, to the conversation as chat_sft renders it."""
    _, model, tokenizer = trained
    ids = Engine(model, tokenizer).generate_batch([render_prompt(tokenizer, messages)], max_tokens=max_tokens,
                                                  temperature=0.0, **kwargs)[0]
    return tokenizer.decode(ids)


def test_a_chat_completion_is_the_engines_answer_to_the_rendered_conversation(client, trained):
    r = client.chat.completions.create(model=MODEL_TAG, messages=USER, max_tokens=6, temperature=0,
                                       extra_body={"n_sup": 2})
    expected = answer(trained, USER, 6, n_sup=2)
    assert expected and r.choices[0].message.content == expected
    assert expected != answer(trained, USER, 6, n_sup=1)  # the step count reaches the model
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL_TAG
    assert (r.choices[0].message.role, r.choices[0].finish_reason) == ("assistant", "length")
    prompt = render_prompt(trained[2], USER)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 6)
    assert r.model_extra["n_sup"] == 2  # the extension field: the steps each token ran
    # a system message opens the first user message; OpenAI's developer role and text parts mean the same
    system = [{"role": "system", "content": "be brief"}, *USER]
    same = [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "cat sat on the", "name": "ann"}]
    replies = {client.chat.completions.create(model=MODEL_TAG, messages=m, max_tokens=5, temperature=0)
               .choices[0].message.content for m in (system, same)}
    assert replies == {answer(trained, system, 5)}


def test_streamed_deltas_carry_the_role_first_then_the_same_text(client, trained):
    request = dict(model=MODEL_TAG, messages=USER, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    # the role alone first, with empty content, as OpenAI sends it; then the text
    assert (pieces[0].delta.role, pieces[0].delta.content) == ("assistant", "")
    assert all(p.delta.role is None for p in pieces[1:])
    assert "".join(p.delta.content for p in pieces) == answer(trained, USER, 8)
    assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_drafts_through_the_openai_client_one_per_step_the_last_the_reply(client, trained):
    """End to end: extra_body={"drafts": True} gives each step's reply, whole and streamed; every chunk parses."""
    request = dict(model=MODEL_TAG, messages=USER, max_tokens=6, temperature=0, extra_body={"drafts": True})
    want = [answer(trained, USER, 6, n_sup=s) for s in (1, 2, 3)]
    assert trained[1].config.n_sup_inference == 3 and want[0] != want[1]  # the steps differ on this prompt
    r = client.chat.completions.create(**request)
    assert r.choices[0].model_extra["drafts"] == want and r.choices[0].message.content == want[-1]
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    drafts = [c for c in chunks if c.choices and "drafts" in c.choices[0].model_extra]
    assert len(drafts) == 1 and chunks[-2:] == [drafts[0], chunks[-1]] and chunks[-1].usage.completion_tokens == 6
    assert drafts[0].choices[0].model_extra["drafts"] == want and drafts[0].choices[0].delta.content is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[-1]
    plain = client.chat.completions.create(**{**request, "extra_body": {"drafts": False}})
    assert "drafts" not in plain.choices[0].model_extra and plain.choices[0].message.content == want[-1]


@pytest.fixture(scope="module")
def local(trained):
    """(an in-process client of a fresh server, the server): the variations below, without a socket."""
    _, model, tokenizer = trained
    server = Server(Engine(model, tokenizer), {"model_tag": MODEL_TAG, "step": 40}, max_concurrency=2)
    with TestClient(create_app(server), base_url="http://localhost") as c:  # TestClient's own Host names no server
        yield c, server


def chat(local, **fields):
    r = local[0].post("/v1/chat/completions", json={"messages": USER, "max_tokens": 6, **fields})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("fields", [{"n": 2, "temperature": 1.0, "seed": 5, "n_sup": 2},
                                    {"temperature": 0, "stop": [" the"], "n_sup": 4},
                                    {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 1}])
def test_each_draft_is_the_reply_a_request_of_that_many_steps_gets(local, fields):
    """drafts[s - 1]: the reply to the same request at n_sup=s (same seed, sampling and stop strings); the last is the
    reply itself; with n, each choice its own."""
    got = chat(local, drafts=True, **fields)
    steps = fields.get("n_sup", 3)
    for s in range(1, steps + 1):
        at_s = chat(local, **{**fields, "n_sup": s})["choices"]
        assert [c["drafts"][s - 1] for c in got["choices"]] == [c["message"]["content"] for c in at_s], s
    assert all(len(c["drafts"]) == steps and c["drafts"][-1] == c["message"]["content"] for c in got["choices"])
    assert len(got["choices"]) == fields.get("n", 1)
    if "stop" in fields:  # cut before the stop string, as the reply is
        assert all(" the" not in d for d in got["choices"][0]["drafts"])


def test_drafts_under_halting_are_every_fixed_steps_reply_and_unseeded_ones_share_a_seed(local, trained,
                                                                                         monkeypatch):
    """n_sup "auto": the reply is no one step's, so drafts are the replies at 1..n_sup_inference steps, all generated.
    Without a seed, the reply and its drafts draw with one seed drawn for the request: they differ by step only."""
    got = chat(local, drafts=True, n_sup="auto", temperature=0)
    assert got["choices"][0]["drafts"] == [answer(trained, USER, 6, n_sup=s) for s in (1, 2, 3)]
    assert got["choices"][0]["message"]["content"] == answer(trained, USER, 6, halt=AUTO_HALTING)
    assert got["n_sup"] == AUTO_HALTING
    monkeypatch.setattr(server_module.random, "getrandbits", lambda bits: 11)  # the seed the request draws
    sampled = chat(local, drafts=True, temperature=1.0, n=3)
    for s in (1, 2, 3):
        seeded = chat(local, temperature=1.0, n=3, seed=11, n_sup=s)["choices"]
        assert [c["drafts"][s - 1] for c in sampled["choices"]] == [c["message"]["content"] for c in seeded]


@pytest.mark.parametrize("value", ["yes", 1, 0, [], {}, "true"])
def test_drafts_must_be_a_json_boolean(local, value):
    r = local[0].post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "drafts": value})
    assert r.status_code == 400 and r.json()["error"] == {"message": "drafts: Input should be a valid boolean",
                                                          "type": "invalid_request_error", "param": "drafts",
                                                          "code": None}
    assert "drafts" not in chat(local, drafts=None)["choices"][0]  # null: the default, as every optional field


def test_drafts_run_in_the_requests_one_slot_and_stop_when_cancelled(local, trained, monkeypatch):
    client, server = local
    held, step_drafts = [], refinement.step_drafts
    monkeypatch.setattr(refinement, "step_drafts", lambda *a, **k: held.append(server.running) or step_drafts(*a, **k))
    streamed = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "drafts": True,
                                                         "stream": True})
    assert held == [1] and server.running == 0 and streamed.text.endswith("data: [DONE]\n\n")
    cancelled = threading.Event()
    cancelled.set()
    prompt = render_prompt(trained[2], USER)
    assert step_drafts(server.engine, [prompt], [1, 2], cancelled, max_tokens=3) is None
    assert [len(d[0]) for d in step_drafts(server.engine, [prompt], [1, 2], threading.Event(), max_tokens=3)] == [3, 3]


def test_halting_by_rule_and_several_choices(client, trained):
    r = client.chat.completions.create(model=MODEL_TAG, messages=USER, max_tokens=6, temperature=0,
                                       extra_body={"n_sup": "auto"})
    assert r.choices[0].message.content == answer(trained, USER, 6, halt=AUTO_HALTING)
    assert r.model_extra["n_sup"] == AUTO_HALTING
    r = client.chat.completions.create(model=MODEL_TAG, messages=USER, max_tokens=4, n=3, temperature=1, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 12


def test_chat_requests_share_the_batch_with_completions(url, trained, monkeypatch):
    submitted, submit = [], Batcher.submit
    monkeypatch.setattr(Batcher, "submit", lambda self, request, stats: submitted.append(request.n_sup) or
                        submit(self, request, stats))
    results = {}

    def send(name, route, body):
        results[name] = httpx.post(f"{url}{route}", json={**body, "temperature": 0, "max_tokens": 6}, timeout=60)
    threads = [threading.Thread(target=send, args=(f"chat{i}", "/v1/chat/completions", {"messages": USER}))
               for i in range(3)] + [threading.Thread(target=send, args=("text", "/v1/completions", {"prompt": "the"}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(submitted) == 4  # every request went through the one batcher
    replies = {results[f"chat{i}"].json()["choices"][0]["message"]["content"] for i in range(3)}
    assert replies == {answer(trained, USER, 6)} and results["text"].status_code == 200


@pytest.mark.parametrize("change, status, message", [
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400,
     "messages: message 0 is from the assistant, but the user is due"),
    ({"messages": USER + [{"role": "assistant", "content": "x"}]}, 400,
     "messages: the last message must be the user's"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role: Input should be"),
    ({"messages": []}, 400, "messages: \"messages\" is not a non-empty list"),
    ({"messages": [{"role": "user", "content": "the cat " * 40}]}, 400, "the conversation is"),
    ({"logprobs": True}, 400, "logprobs=True is not supported"),
    ({"tools": []}, 400, "tools: unknown field"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, 400, "max_tokens and max_completion_tokens differ"),
    ({"max_tokens": 10 ** 6}, 400, "exceeds this server's limit of 32"),
    ({"n_sup": 99}, 400, "n_sup=99: must be from 1 to 12"),
    ({"model": "gpt-4o"}, 404, "model 'gpt-4o' does not exist"),
])
def test_a_bad_chat_request_is_answered_in_openais_error_shape(url, change, status, message):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **change}, timeout=30)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert httpx.get(f"{url}/health").json()["running"] == 0  # a refused request holds no slot


def test_the_key_guards_the_chat_route(trained, tmp_path, capsys):
    from scripts import chat_eval
    _, model, tokenizer = trained
    server = Server(Engine(model, tokenizer), {"model_tag": MODEL_TAG, "step": 40})
    http = uvicorn.Server(uvicorn.Config(create_app(server, api_key=KEY), log_level="warning", lifespan="off"))
    with support_server.running(http) as base_url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model=MODEL_TAG, messages=USER, max_tokens=2)
        keyed = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert keyed.chat.completions.create(model=MODEL_TAG, messages=USER, max_tokens=3,
                                             temperature=0).choices[0].message.content == answer(trained, USER, 3)
        # chat_eval --server sends the key for /health too, which names the model and its steps only to its holder
        data = tmp_path / "qa.jsonl"
        data.write_text(json.dumps({"messages": [*USER, {"role": "assistant", "content": "x"}]}) + "\n")
        with pytest.raises(SystemExit) as refused:
            chat_eval.main([f"--server={base_url}", f"--api_key={KEY}", f"--data={data}", "--n_sup=99",
                            f"--out={tmp_path}"])
        out = capsys.readouterr()
        assert refused.value.code == 2 and "the server runs 1 to" in out.out + out.err


def test_the_refinement_route_answers_a_conversation_step_by_step(url, trained):
    r = httpx.post(f"{url}/v1/refinement", json={"messages": USER, "max_tokens": 6, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["text"] == answer(trained, USER, 6)
    assert all(len(token["steps"]) == trained[1].config.n_sup_inference for token in r.json()["tokens"])
    both = httpx.post(f"{url}/v1/refinement", json={"messages": USER, "prompt": "the"}, timeout=30)
    assert both.status_code == 400 and "send prompt (a text) or messages" in both.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/refinement", json={"messages": USER * 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_chat_eval_through_the_server_scores_as_in_process(url, trained, tmp_path, monkeypatch):
    """chat_eval --server: the same questions through lm-eval's chat backend, the same replies and exact match at
    every step as the model evaluated in-process (a system message folded in as the rendering folds it). One run of
    the command (each step is one lm-eval run of seconds) checks evaluate_chat_server and the CLI around it."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("lm_eval", reason="lm-eval is the optional [eval] extra: pip install -e '.[eval]'")
    from nanochat.eval.chat_eval import evaluate_chat, items_from
    from scripts import chat_eval
    right_at_2 = answer(trained, USER, 5, n_sup=2).strip()  # right from step 2 on, wrong at step 1
    conversations = [[*USER, {"role": "assistant", "content": right_at_2}],
                     [{"role": "system", "content": "mat"}, {"role": "user", "content": "dog"},  # the system
                      {"role": "assistant", "content": "no"}]]  # message changes this reply
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    with pytest.raises(SystemExit) as refused:
        chat_eval.main([f"--server={url}", f"--data={data}", "--n_sup=99", f"--out={tmp_path}"])
    assert refused.value.code == 2
    served = chat_eval.main([f"--server={url}", f"--data={data}", "--n_sup=2", "--max_tokens=5", f"--out={tmp_path}"])
    here = evaluate_chat(trained[1], trained[2], items_from(str(data)), 2, max_tokens=5)
    echo = here["examples"][str(data)][0]["replies"]
    assert echo[1] == right_at_2 != echo[0]  # the steps differ, and the score sees it
    assert served["all"]["accuracy"] == here["all"]["accuracy"] and served["all"]["accuracy"][1] > 0
    assert served["examples"] == here["examples"] and served["all"]["ended"] == [None] * 2
    assert served["server"] == url and served["n_sup_train"] == trained[1].config.n_sup_train
    written = {p.name for p in tmp_path.iterdir()}
    assert written >= {f"chat_eval_step000040_server.{ext}" for ext in ("json", "md", "png")}


CHROMIUM = find_chromium()


# the Chat tab as shown: its error line, and each transcript line with the drafts and the note under a reply
CHAT_TAB = """({error: document.getElementById('error').textContent,
  transcript: [...document.querySelectorAll('#transcript > *')].map((e) => e.tagName === 'DIV'
    ? [e.dataset.role, e.textContent]
    : e.tagName === 'OL' ? ['drafts', [...e.querySelectorAll('li')].map((li) => [li.textContent, li.className])]
    : ['note', e.textContent])})"""


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (tests/support/chromium.py says how)")
def test_the_chat_tab_shows_every_steps_draft_of_each_reply_and_keeps_the_conversation(url, trained):
    """The tab talks to /v1/chat/completions with drafts: true (streamed): each reply joins the transcript with its
    draft at every step under it, a draft that differs from the reply highlighted, and when every step agrees a note
    saying so."""
    turns = [("cat sat on the", 6), ("the", 1)]  # the steps differ on the first (see USER); one token: they agree
    with Chromium(CHROMIUM, timeout_s=90) as browser:
        browser.open(f"{url}/")
        browser.wait_for("['ready', 'error', 'done'].includes(document.body.dataset.state)")
        browser.click("nav button[data-tab=chat]")
        pages = []
        for turn, max_tokens in turns:
            browser.type_into("#chat_max_tokens", str(max_tokens))
            browser.type_into("#message", turn)
            browser.click("#chat button[type=submit]")
            browser.wait_for("['done', 'error'].includes(document.body.dataset.state)")
            pages.append(browser.evaluate(CHAT_TAB))
    conversation, shown = [], []
    for (turn, max_tokens), page in zip(turns, pages):
        conversation.append({"role": "user", "content": turn})
        want = httpx.post(f"{url}/v1/chat/completions", json={"messages": conversation, "max_tokens": max_tokens,
                                                               "temperature": 0, "seed": 42, "drafts": True},
                          timeout=60).json()["choices"][0]
        reply, drafts = want["message"]["content"], want["drafts"]
        assert page["error"] == "" and len(drafts) == trained[1].config.n_sup_inference
        conversation.append({"role": "assistant", "content": reply})
        shown += [["user", turn], ["assistant", reply],
                  ["drafts", [[f"step {s} draft: {json.dumps(d)}", "" if d == reply else "diff"]
                              for s, d in enumerate(drafts, start=1)]]]
        if len(set(drafts)) == 1:
            shown.append(["note", f"every step gave the same reply: at this model's scale the {len(drafts)} steps "
                                  "agree"])
        assert page["transcript"] == shown
    assert "diff" in str(pages[0]["transcript"]) and pages[1]["transcript"][-1][0] == "note"  # both cases were seen
