"""The refinement viewer (nanochat/serve/viewer.html) in a real headless Chromium against a server with the tiny
model: a prompt typed and submitted with a click, the stream waited for, every step's row and the halting colours
checked against the JSON the same request gets. The browser tests are skipped, saying how to install it, where no
Chromium is installed; what can be read from the page's script alone is checked without one.

VIEWER_SCREENSHOT=dev/results/viewer.png pytest tests/test_viewer.py  # also saves what the browser showed"""

import base64
import contextlib
import hashlib
import json
import os
import random
import re

import httpx
import pytest

from nanochat.data.dataset import SYNTHETIC, synthetic_flags, write_source
from nanochat.data.synthetic import HopsSpec, pairs_document
from nanochat.model.engine import Engine
from nanochat.serve import refinement
from nanochat.serve.http import page_policy
from nanochat.serve.server import Server, create_app
from tests.support import server as support_server
from tests.support.chromium import INSTALL, Chromium, find_chromium
from tests.support.tiny_checkpoint import MODEL_TAG, tiny_checkpoint

CHROMIUM = find_chromium()
browser_test = pytest.mark.skipif(CHROMIUM is None, reason=f"no Chromium on this machine: {INSTALL}")
KEY = "sk-viewer-test"
BROWSER_S = 90  # the hard limit on each browser session
SETTINGS = {"max_tokens": 8, "temperature": 1.0, "top_k": 50, "seed": 7, "halt": "kl:0.0005"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@contextlib.contextmanager
def serving(trained, api_key=None, hops_corpus=None):
    _, model, tokenizer = trained
    server = Server(Engine(model, tokenizer), {"model_tag": MODEL_TAG, "step": 40}, hops_corpus=hops_corpus)
    with support_server.serving(create_app(server, api_key)) as url:
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


def fill_and_generate(browser, prompt, drafts=False, **settings):
    browser.wait_for("['ready', 'error', 'done'].includes(document.body.dataset.state)")
    browser.type_into("#prompt", prompt)
    for name, value in {**SETTINGS, **settings}.items():
        browser.type_into(f"#{name}" if name != "n_sup" else "#generate .n_sup", str(value))
    if drafts:
        browser.click("#drafts")
    browser.click("#generate button[type=submit]")
    browser.wait_for("['done', 'error'].includes(document.body.dataset.state)")


# every Content-Security-Policy violation the page causes from now on (an inline style refused, a script blocked)
WATCH_POLICY = ("window.violations = []; document.addEventListener('securitypolicyviolation', "
                "(e) => window.violations.push(`${e.violatedDirective}: ${e.sample}`)); true")

# the score heat map, step by step: each token's loss as shown and its colour
HEAT = """(() => {
  const columns = [...document.querySelectorAll('#heat .token')];
  const steps = columns.length ? columns[0].querySelectorAll('.loss').length : 0;
  return Array.from({length: steps}, (_, s) => columns.map((c) => {
    const cell = c.querySelectorAll('.loss')[s];
    return [cell.textContent, getComputedStyle(cell).backgroundColor];
  }));
})()"""

# how the heat map's token columns lie: right edges against the map's, and how many lines they take
HEAT_LAYOUT = """(() => {
  const map = document.getElementById('heat').getBoundingClientRect();
  const columns = [...document.querySelectorAll('#heat .token')].map((c) => c.getBoundingClientRect());
  return {right: Math.max(...columns.map((r) => r.right)), width: map.right,
          lines: new Set(columns.map((r) => Math.round(r.top))).size,
          overflow: document.getElementById('out').scrollWidth > document.getElementById('out').clientWidth};
})()"""


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


@browser_test
def test_a_typed_prompt_streams_every_steps_row_and_the_halting_colours_then_score_and_hops_render(trained):
    prompt, text = "the dog sat", "the cat sat on the mat. the dog sat on the log. the dog sat on the mat."
    with serving(trained) as url, Chromium(CHROMIUM, timeout_s=BROWSER_S) as browser:
        want = httpx.post(f"{url}/v1/refinement", json={"prompt": prompt, **SETTINGS, "drafts": True},
                          timeout=60).json()
        browser.open(f"{url}/")
        browser.evaluate(WATCH_POLICY)
        fill_and_generate(browser, prompt, drafts=True)
        page = browser.evaluate(RENDERED)
        drafts = browser.evaluate("[[...document.querySelectorAll('#step_drafts div')].map((d) => d.textContent), "
                                  "document.body.innerText, document.getElementById('drafts').childNodes.length]")
        browser.evaluate("document.body.style.width = '360px'; true")  # a narrow window: the heat map must wrap
        submit_tab(browser, "score", "#text", text)
        heat, layout = browser.evaluate(HEAT), browser.evaluate(HEAT_LAYOUT)
        scored = httpx.post(f"{url}/v1/refinement", json={"mode": "score", "text": text}, timeout=60).json()
        submit_tab(browser, "hops", "#hopstext", "a>b b>c c>a ; a1=b c2=b")
        hops = browser.evaluate("[...document.querySelectorAll('#queries tr')].slice(1).map((r) => "
                                "[...r.querySelectorAll('td.right, td.wrong')].map((td) => td.className))")
        answered = httpx.post(f"{url}/v1/refinement", json={"mode": "hops", "text": "a>b b>c c>a ; a1=b c2=b"},
                              timeout=60).json()
        browser.evaluate("document.body.style.width = ''; true")
        browser.click("nav button[data-tab=chat]")
        browser.type_into("#chat_max_tokens", "6")  # within the tiny model's 32
        submit_tab(browser, "chat", "#message", "cat sat on the")  # the screenshot shows the Chat tab's drafts
        chatted = browser.evaluate("[...document.querySelectorAll('#transcript ol.drafts li')].map((li) => "
                                   "li.textContent)")
        png = browser.screenshot()
        violations = browser.evaluate("window.violations")
    assert violations == []  # the page runs under its own Content-Security-Policy: every colour below is allowed
    assert [[text for text, _ in row] for row in heat] == [[f"{v:.1f}" for v in row] for row in scored["losses"]]
    assert len(scored["tokens"]) > 15 and layout["lines"] > 1 and layout["right"] <= layout["width"] + 0.5
    assert not layout["overflow"]  # the tokens wrap onto lines: nothing runs off the right edge
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
    # "each step's own greedy draft": shown under the table, one line per step, as the API gives them
    shown, seen, inside_checkbox = drafts
    assert shown == [f"step {s} draft: {json.dumps(d)}" for s, d in enumerate(want["drafts"], start=1)]
    assert len(shown) == n_sup and all(line in seen for line in shown) and inside_checkbox == 0
    assert len(chatted) == n_sup and all(line.startswith(f"step {s} draft: ") for s, line in enumerate(chatted, 1))
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    if os.environ.get("VIEWER_SCREENSHOT"):
        with open(os.environ["VIEWER_SCREENSHOT"], "wb") as f:
            f.write(png)


@browser_test
def test_the_hops_tab_draws_from_the_models_own_corpus_and_runs_past_the_trained_steps(trained, tmp_path):
    """A checkpoint whose data directory holds the hops_pairs corpus: the page says so, a document drawn with a seed
    is one of that corpus, and the page runs 4x the trained supervision steps, marking those past training."""
    spec = HopsSpec(n_symbols=5, max_hops=2, n_queries=6)  # 31 characters: within the tiny model's context
    write_source(str(tmp_path), f"{SYNTHETIC} {synthetic_flags('hops_pairs', 0, 1000, spec)}")
    corpus = refinement.trained_hops_corpus({"data": {"dir": str(tmp_path), "fingerprint": "0" * 12}})
    trained_steps = trained[1].config.n_sup_train
    most = 4 * trained_steps
    with serving(trained, hops_corpus=corpus) as url, Chromium(CHROMIUM, timeout_s=BROWSER_S) as browser:
        browser.open(f"{url}/")
        browser.wait_for("document.body.dataset.state === 'ready'")
        said = browser.evaluate("[document.getElementById('corpus').textContent, "
                                "document.querySelector('#hops .n_sup').max]")
        browser.click("nav button[data-tab=hops]")
        browser.type_into("#hopsseed", "3")
        browser.type_into("#hops .n_sup", str(most))
        browser.click("#hops button[type=submit]")
        browser.wait_for("['done', 'error'].includes(document.body.dataset.state)")
        hops = browser.evaluate("""[document.body.dataset.state, document.getElementById('error').textContent,
            document.getElementById('hopstext').value,
            [...document.querySelectorAll('#queries tr:first-child td[data-step]')].map((td) => td.className),
            document.querySelectorAll('#accuracy tr').length - 1]""")
        browser.click("nav button[data-tab=generate]")
        fill_and_generate(browser, "the cat", n_sup=most, max_tokens=3)
        generated = browser.evaluate(RENDERED)
    assert said == ["A drawn document comes from hops_pairs (5 symbols, 1-2 hops, 6 queries): the corpus this model "
                    "was trained on.", str(most)]
    state, error, text, step_classes, accuracy_rows = hops
    assert state == "done", error
    assert text == pairs_document(random.Random(3), spec)  # the corpus's generator, the seed typed in
    assert step_classes == [""] * trained_steps + ["past"] * (most - trained_steps) and accuracy_rows == most
    assert generated["state"] == "done" and len(generated["steps"]) == most, generated["error"]


@browser_test
def test_the_page_asks_for_the_key_says_why_and_keeps_it_in_the_tab(trained):
    with serving(trained, api_key=KEY) as url, Chromium(CHROMIUM, timeout_s=BROWSER_S) as browser:
        reason = httpx.get(f"{url}/v1/models", timeout=30).json()["error"]["message"]
        browser.open(f"{url}/")
        browser.wait_for("document.body.dataset.state === 'ready'")
        asked = browser.evaluate("[document.getElementById('keybox').hidden, "
                                 "document.getElementById('keywhy').textContent]")
        unknown = browser.evaluate("document.getElementById('model').textContent")  # /health says "ok" alone
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
        browser.wait_for(f"document.getElementById('model').textContent.includes({json.dumps(MODEL_TAG)})")
        model = browser.evaluate("document.getElementById('model').textContent")  # /health read with the key
        stored = browser.evaluate("JSON.stringify([localStorage.length, sessionStorage.length, document.cookie, "
                                  "location.href, document.getElementById('key').value])")
    assert asked == [False, f"This server needs an API key: {reason}"]  # before any run, with the server's reason
    assert unknown == "model: shown once the API key is given"
    assert model.startswith(f"model: {MODEL_TAG}, step 40; trained with {trained[1].config.n_sup_train} supervision")
    assert reason.startswith("no API key")
    state, hidden, why, error = refused
    assert state == "error" and not hidden and error.startswith("401: no API key")
    assert why.startswith("This server needs an API key: no API key: send the header Authorization: Bearer <key>")
    assert wrong.startswith("This server needs an API key: incorrect API key")
    assert page["state"] == "done" and len(page["steps"]) == trained[1].config.n_sup_inference
    assert all(len(row) == SETTINGS["max_tokens"] for row in page["steps"])
    assert KEY not in stored and json.loads(stored)[:3] == [0, 0, ""]


# the page's state, whether it says the link asks to run, where the focus is, the prompt and the rows drawn
LINK_STATE = """[document.body.dataset.state, document.getElementById('linkrun').hidden,
  document.activeElement === document.querySelector('#generate button[type=submit]'),
  document.getElementById('prompt').value, document.getElementById('max_tokens').value,
  document.querySelectorAll('#steps tr.step').length]"""


def refinement_requests(url):
    """How many /v1/refinement requests the server has answered (its /metrics)."""
    line = next((x for x in httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
                 if x.startswith('nanochat_requests_total{route="/v1/refinement"')), None)
    return 0 if line is None else float(line.split()[-1])


@browser_test
def test_a_link_with_run_1_fills_the_form_and_waits_for_a_click(trained):
    """Any site can link to the page: the link may fill the form, only a click makes the server generate."""
    with serving(trained) as url, Chromium(CHROMIUM, timeout_s=BROWSER_S) as browser:
        browser.open(f"{url}/#prompt=the%20dog&max_tokens=3&seed=5&run=1")
        browser.wait_for("['ready', 'running', 'done', 'error'].includes(document.body.dataset.state)")
        linked = browser.evaluate(LINK_STATE)
        asked = refinement_requests(url)
        browser.click("#generate button[type=submit]")
        browser.wait_for("['done', 'error'].includes(document.body.dataset.state)")
        clicked = browser.evaluate(LINK_STATE)
        answered = refinement_requests(url)
    assert linked == ["ready", False, True, "the dog", "3", 0] and asked == 0  # filled, said, focused; not run
    assert clicked[:2] == ["done", True] and clicked[-1] == trained[1].config.n_sup_inference and answered == 1


def page_script():
    with open(refinement.PAGE, encoding="utf-8") as f:
        return re.findall(r"<script>(.*?)</script>", f.read(), re.DOTALL)[0]


def test_the_page_never_runs_a_form_itself():
    """Without a browser: nothing in the page's script submits a form or clicks, and the runners (every path to a
    generation) are called from the forms' submit listener only, so no link can start a generation."""
    script = page_script()
    assert not re.search(r"requestSubmit|\.submit\(|\.click\(|new (Submit|Mouse|Pointer)Event|Event\(\"submit",
                         script)
    calls = [line.strip() for line in script.splitlines() if re.search(r"runners\[[^\]]+\]\(", line)]
    assert len(calls) == 2 and 'addEventListener("submit"' in calls[1], calls
    # the other: run() (a runner's own call, so after a submit) keeps its form to submit again once a key is given,
    # and only the key button's click does that
    assert calls[0] == "lastRun = () => runners[form]();"
    assert [line.strip() for line in script.splitlines() if re.search(r"lastRun\(\)", line)] == \
        ["describeServer().catch(() => { /* the run below says what is wrong */ }).finally(() => { if (lastRun) "
         "lastRun(); });"]
    assert script.index("lastRun = () =>") > script.index("function run(")
    assert re.findall(r"\bpost\(", script) == ["post("] * 2  # its definition and run's one call
    assert script.count("fetch(") == 3  # post, /health and /v1/models only
    # post's routes: run's default, and the Chat tab's, which asks for every step's draft of the streamed reply
    assert sorted(re.findall(r'"(/v1/[a-z/]+)"', script)) == ["/v1/chat/completions", "/v1/models", "/v1/refinement"]
    chat = script[script.index("function chat()"):script.index("$(\"newchat\")")]
    assert "stream: true, drafts: true}" in chat and '"/v1/chat/completions")' in chat


def test_the_pages_policy_allows_its_own_script_and_style_as_they_are_now():
    """The Content-Security-Policy names the page's inline script and style by their SHA-256, computed from the file
    when the server starts: an edited script is allowed, and nothing else is."""
    with open(refinement.PAGE, encoding="utf-8") as f:
        page = f.read()
    policy = dict(d.strip().split(" ", 1) for d in page_policy(refinement.PAGE).split(";"))
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        body = page.split(f"<{tag}>")[1].split(f"</{tag}>")[0]
        assert policy[directive] == f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
