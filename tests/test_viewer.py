"""The refinement viewer (nanochat/serve/viewer.html) in a real headless Chromium against a server with the tiny model: a
prompt typed and submitted with a click, the stream waited for, every step's row and the halting colours checked
against the JSON the same request gets. Skipped, saying how to install it, where no Chromium is installed.

VIEWER_SCREENSHOT=dev/results/viewer.png pytest tests/test_viewer.py  # also saves what the browser showed"""

import contextlib
import json
import os

import httpx
import pytest

from nanochat.model.engine import Engine
from scripts import serve
from tests.support import server as support_server
from tests.support.chromium import INSTALL, Chromium, find_chromium
from tests.support.tiny_checkpoint import MODEL_TAG, tiny_checkpoint

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason=f"no Chromium on this machine: {INSTALL}")
KEY = "sk-viewer-test"
BROWSER_S = 90  # the hard limit on each browser session
SETTINGS = {"max_tokens": 8, "temperature": 1.0, "top_k": 50, "seed": 7, "halt": "kl:0.0005"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@contextlib.contextmanager
def serving(trained, api_key=None):
    _, model, tokenizer = trained
    server = serve.Server(Engine(model, tokenizer), {"model_tag": MODEL_TAG, "step": 40})
    with support_server.serving(serve.create_app(server, api_key)) as url:
        yield url


def visible(text):
    """A token as the page shows it in a cell: spaces, line breaks and tabs drawn, nothing as an empty set."""
    return text.replace(" ", "\u00b7").replace("\n", "\u21b5").replace("\t", "\u2192") or "\u2205"


def submit_tab(browser, tab, field, text):
    """Open a tab of the page, type text into its field, submit, and wait until the request has ended."""
    browser.click(f"nav button[data-tab={tab}]")
    browser.type_into(field, text)
    browser.click(f"#{tab} button[type=submit]")
    browser.wait_for("['done', 'error'].includes(document.body.dataset.state)")


def fill_and_generate(browser, prompt):
    browser.wait_for("['ready', 'error'].includes(document.body.dataset.state)")
    browser.type_into("#prompt", prompt)
    for name, value in SETTINGS.items():
        browser.type_into(f"#{name}", str(value))
    browser.click("#generate button[type=submit]")
    browser.wait_for("['done', 'error'].includes(document.body.dataset.state)")


RENDERED = """(() => {
  const cells = (row) => [...row.querySelectorAll('td')];
  const steps = [...document.querySelectorAll('#steps tr.step')];
  return {
    state: document.body.dataset.state, error: document.getElementById('error').textContent,
    steps: steps.map((r) => cells(r).map((td) => td.firstChild.textContent)),  // the token, not its probability
    diff: steps.map((r) => cells(r).map((td) => td.classList.contains('diff'))),
    answer: cells(document.querySelector('#steps tr.final')).map((td) => td.textContent),
    halts: cells(document.querySelector('#steps tr.halt'))
      .map((td) => [td.textContent, getComputedStyle(td).backgroundColor]),
    summary: document.getElementById('summary').textContent,
  };
})()"""


def test_a_typed_prompt_streams_every_steps_row_and_the_halting_colours_then_score_and_hops_render(trained):
    prompt = "the dog sat"
    with serving(trained) as url, Chromium(CHROMIUM, timeout_s=BROWSER_S) as browser:
        want = httpx.post(f"{url}/v1/refinement", json={"prompt": prompt, **SETTINGS}, timeout=60).json()
        browser.open(f"{url}/")
        fill_and_generate(browser, prompt)
        page = browser.evaluate(RENDERED)
        png = browser.screenshot()
        submit_tab(browser, "score", "#text", "the cat sat on the mat.")
        heat = browser.evaluate("[...document.querySelectorAll('#heat tr.step')].map((r) => [...r.querySelectorAll('td')]"
                                ".map((td) => [td.textContent, getComputedStyle(td).backgroundColor]))")
        scored = httpx.post(f"{url}/v1/refinement", json={"mode": "score", "text": "the cat sat on the mat."},
                            timeout=60).json()
        submit_tab(browser, "hops", "#hopstext", "a>b b>c c>a ; a1=b c2=b")
        hops = browser.evaluate("[...document.querySelectorAll('#queries tr')].slice(1).map((r) => "
                                "[...r.querySelectorAll('td.right, td.wrong')].map((td) => td.className))")
        answered = httpx.post(f"{url}/v1/refinement", json={"mode": "hops", "text": "a>b b>c c>a ; a1=b c2=b"},
                              timeout=60).json()
    assert [[text for text, _ in row] for row in heat] == [[f"{v:.1f}" for v in row] for row in scored["losses"]]
    hottest = max(range(len(scored["losses"][0])), key=lambda t: scored["losses"][0][t])
    coolest = min(range(len(scored["losses"][0])), key=lambda t: scored["losses"][0][t])
    assert heat[0][hottest][1] != heat[0][coolest][1]  # the heat map's colours follow the loss
    assert hops == [["right" if step["correct"] else "wrong" for step in q["steps"]] for q in answered["queries"]]
    assert page["state"] == "done", page["error"]
    tokens, n_sup = want["tokens"], want["n_sup"]
    assert len(page["steps"]) == n_sup == trained[1].config.n_sup_inference and len(tokens) == 8
    for s in range(n_sup):
        assert page["steps"][s] == [visible(t["steps"][s]["text"]) for t in tokens]
        assert page["diff"][s] == [t["steps"][s]["id"] != t["id"] for t in tokens]
    assert page["answer"] == [visible(t["text"]) for t in tokens]
    assert [int(text) for text, _ in page["halts"]] == [t["halt_step"] for t in tokens]
    colour = {}
    for text, background in page["halts"]:  # one colour per halting step, a different one for each step
        assert background not in ("", "rgba(0, 0, 0, 0)") and colour.setdefault(text, background) == background
    assert len(set(colour.values())) == len(colour) > 1
    assert f"mean {want['mean_halt_steps']:.2f} of {n_sup} steps per token" in page["summary"]
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    if os.environ.get("VIEWER_SCREENSHOT"):
        with open(os.environ["VIEWER_SCREENSHOT"], "wb") as f:
            f.write(png)


def test_the_page_asks_for_the_key_says_why_and_keeps_it_in_the_tab(trained):
    with serving(trained, api_key=KEY) as url, Chromium(CHROMIUM, timeout_s=BROWSER_S) as browser:
        reason = httpx.get(f"{url}/v1/models", timeout=30).json()["error"]["message"]
        browser.open(f"{url}/")
        browser.wait_for("document.body.dataset.state === 'ready'")
        asked = browser.evaluate("[document.getElementById('keybox').hidden, "
                                 "document.getElementById('keywhy').textContent]")
        fill_and_generate(browser, "the cat")
        refused = browser.evaluate("[document.body.dataset.state, document.getElementById('keybox').hidden, "
                                   "document.getElementById('keywhy').textContent, "
                                   "document.getElementById('error').textContent]")
        browser.type_into("#key", "wrong")
        browser.click("#usekey")
        browser.wait_for("document.body.dataset.state === 'error'")
        wrong = browser.evaluate("document.getElementById('keywhy').textContent")
        browser.type_into("#key", KEY)
        browser.click("#usekey")
        browser.wait_for("['done', 'error'].includes(document.body.dataset.state)")
        page = browser.evaluate(RENDERED)
        stored = browser.evaluate("JSON.stringify([localStorage.length, sessionStorage.length, document.cookie, "
                                  "location.href, document.getElementById('key').value])")
    assert asked == [False, f"This server needs an API key: {reason}"]  # before any run, with the server's reason
    assert reason.startswith("no API key")
    state, hidden, why, error = refused
    assert state == "error" and not hidden and error.startswith("401: no API key")
    assert why.startswith("This server needs an API key: no API key: send the header Authorization: Bearer <key>")
    assert wrong.startswith("This server needs an API key: incorrect API key")
    assert page["state"] == "done" and len(page["steps"]) == trained[1].config.n_sup_inference
    assert all(len(row) == SETTINGS["max_tokens"] for row in page["steps"])
    assert KEY not in stored and json.loads(stored)[:3] == [0, 0, ""]
