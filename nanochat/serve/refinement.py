"""
What each supervision step did, as JSON: the data behind the server's /v1/refinement route and its viewer page
(nanochat/serve/viewer.html), usable from scripts and notebooks too.

Three modes, one request body each (api.REFINEMENT_MODES; check_request checks it against the model and says what
is wrong in one sentence):

- generate: a completion sampled as the engine samples it (same seed, same tokens), and for every generated token
  what each step 1..n_sup would have put there given the same prefix (its greedy token and probability, and the
  chosen token's probability), and the step at which a halting rule would have stopped that token. A forward with
  the cache computes every step for the last position anyway; the extra cost is the head on each step's answer.
  drafts: true adds base_sample --show_steps' drafts: each step's own greedy continuation (n_sup more generations).
  The prompt is a text (after <|bos|>) or messages, a conversation rendered as chat_sft trained on it
  (nanochat/data/chat.py) and answered until <|assistant_end|>, token by token as the Generate tab shows a text.
- score: a pasted text teacher-forced, each token's loss (nats) at every step: where later steps help.
- hops: a hops document (pasted, or drawn from a seed out of the corpus the model was trained on: HopsCorpus), each
  query's predicted answer at every step, by hop count.

Every mode runs up to STEPS_PAST_TRAINING times the trained supervision steps (most_steps), as base_loss may: what
the recursion does past the steps it learned is a question the page should be able to show.

Probabilities are the model's (softmax of the logits), before temperature, top-k and top-p.
"""

import os
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanochat.data.chat import prompt_problem, render_prompt
from nanochat.data.synthetic import FAMILIES, HopsSpec, encode_hops, hops_answers
from nanochat.model.engine import left_pad, sample_next
from nanochat.model.halting import HALTING_RULES, Draft, Halting, check_halting

STEPS_PAST_TRAINING = 4  # requests may run up to 4x the trained supervision steps
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "viewer.html")  # the viewer, served at /


class RequestError(ValueError):
    """A request the route answers with a 400: the message says what is wrong; param names the field."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


def most_steps(config):
    """The most supervision steps a request may run: STEPS_PAST_TRAINING x the trained ones (or n_sup_inference, if
    more); a request that names none runs n_sup_inference, as the model was configured."""
    return max(config.n_sup_inference, STEPS_PAST_TRAINING * config.n_sup_train)


@dataclass(frozen=True)
class HopsCorpus:
    """The hops corpus a drawn document comes from: family (synthetic.FAMILIES) and spec; source: the corpus's
    recorded source (its dataset manifest) when the model's checkpoint leads to it, None for the default corpus."""
    family: str = "hops"
    spec: HopsSpec = HopsSpec()
    source: str | None = None

    def draw(self, seed, n_queries=None):
        """One document of this corpus, drawn with random.Random(seed); n_queries: that many queries instead."""
        spec = self.spec if n_queries is None else HopsSpec(self.spec.n_symbols, self.spec.max_hops, n_queries)
        return FAMILIES[self.family](random.Random(seed), spec)

    def describe(self):
        """For /health and the page."""
        return {"family": self.family, "n_symbols": self.spec.n_symbols, "max_hops": self.spec.max_hops,
                "n_queries": self.spec.n_queries, "source": self.source}


def hops_corpus_of(source):
    """The HopsCorpus a corpus's recorded source describes ("synthetic: --synthetic=hops_pairs ... --hops_symbols=7
    ..."), or None when it is not a hops corpus."""
    from nanochat.data.dataset import SYNTHETIC
    if not source or not source.startswith(SYNTHETIC):
        return None
    flags = dict(arg[2:].split("=", 1) for arg in source[len(SYNTHETIC):].split()
                 if arg.startswith("--") and "=" in arg)
    if flags.get("synthetic") not in FAMILIES:
        return None
    default = HopsSpec()
    try:
        spec = HopsSpec(int(flags.get("hops_symbols", default.n_symbols)), int(flags.get("hops_max", default.max_hops)),
                        int(flags.get("hops_queries", default.n_queries)))
    except ValueError:
        return None
    return HopsCorpus(flags["synthetic"], spec, source)


def trained_hops_corpus(meta):
    """The hops corpus a checkpoint was trained on, as base_loss --hops finds it: the manifest of the data directory
    its meta records, else of the current one (NANOCHAT_DATA_DIR) when its fingerprint is the meta's; None when
    neither is a hops corpus (a model of text, a checkpoint without data, a corpus since deleted)."""
    data = meta.get("data") or {}
    if not data:
        return None
    from nanochat.data.dataset import (  # pyarrow: ~30 MB, when needed
        DatasetError,
        corpus_identity,
        data_dir,
        read_source,
    )
    candidates = [data.get("dir")]
    try:
        current = data_dir(create=False)
        if data.get("fingerprint") and corpus_identity(current)["fingerprint"] == data["fingerprint"]:
            candidates.append(current)
    except (DatasetError, OSError):
        pass
    for directory in candidates:
        try:
            corpus = hops_corpus_of(read_source(directory)) if directory and os.path.isdir(directory) else None
        except (OSError, ValueError, KeyError, TypeError):  # an unreadable manifest: as if there were none
            corpus = None
        if corpus is not None:
            return corpus
    return None


@dataclass
class Request:
    mode: str
    ids: list  # prompt (generate) or document (score, hops) token ids, <|bos|> first
    n_sup: int
    text: str = ""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    halting: Halting | None = None
    drafts: bool = False
    stream: bool = False
    answers: list | None = None  # hops: (index in ids, hops, token id, bytes) per query


def check_request(engine, body, max_tokens_limit, default_halt, hops_corpus=HopsCorpus()):
    """A Request from a parsed body (api.RefineGenerate, RefineScore or RefineHops), checked against the model and
    tokenized; a RequestError naming the first problem. default_halt: the halting rule generate marks each token with
    when the request names none ('RULE:THRESHOLD'); hops_corpus: where hops mode draws a document from."""
    mode, got = body.mode, body.model_dump()
    model, config = engine.model, engine.model.config
    most = most_steps(config)
    n_sup = config.n_sup_inference if got["n_sup"] is None else got["n_sup"]
    if not 1 <= n_sup <= most:
        raise RequestError(f"n_sup={n_sup}: must be from 1 to {most} ({STEPS_PAST_TRAINING}x the "
                           f"{config.n_sup_train} supervision steps the model was trained with)", "n_sup")
    if mode == "hops":
        return parse_hops(engine, got, n_sup, hops_corpus)
    if mode == "generate" and (body.prompt is None) == (body.messages is None):
        raise RequestError("generate: send prompt (a text) or messages (a conversation), one of them", "prompt")
    if mode == "generate" and body.messages is not None:
        text, ids = "", chat_prompt(engine, body.messages)
    else:
        text = got["prompt" if mode == "generate" else "text"]
        if not text:
            raise RequestError(f"{'prompt' if mode == 'generate' else 'text'}: a non-empty string is required",
                               "prompt" if mode == "generate" else "text")
        ids = engine.encode_prompt(text)
    if mode == "score":
        check_length(ids[:-1], config.sequence_len, "text")
        if len(ids) < 2:
            raise RequestError("text: needs at least one token to score", "text")
        return Request(mode, ids, n_sup, text=text)
    check_length(ids, config.sequence_len, "prompt")
    if config.n_coda:
        raise RequestError("generate mode needs a model without a coda (n_coda=0): the cache holds a coda's keys for "
                           "the last step only, so earlier steps' tokens cannot be computed; use mode score")
    checks = [("max_tokens", 1 <= got["max_tokens"] <= max_tokens_limit, f"from 1 to {max_tokens_limit}"),
              ("temperature", 0 <= got["temperature"] <= 2, "from 0 to 2"),
              ("top_k", got["top_k"] is None or got["top_k"] >= 1, ">= 1"),
              ("top_p", got["top_p"] is None or 0 <= got["top_p"] <= 1, "from 0 to 1"),
              ("seed", got["seed"] is None or 0 <= got["seed"] < 2 ** 63, "from 0 to 2**63-1")]
    for name, ok, allowed in checks:
        if not ok:
            raise RequestError(f"{name}={got[name]}: must be {allowed}", name)
    try:
        halting = check_halting(model, Halting.parse(got["halt"] or default_halt))
    except ValueError as e:
        raise RequestError(f"halt: {e}", "halt") from None
    return Request(mode, ids, n_sup, text=text, max_tokens=got["max_tokens"], temperature=float(got["temperature"]),
                   top_k=got["top_k"], top_p=got["top_p"], seed=got["seed"], halting=halting, drafts=got["drafts"],
                   stream=got["stream"])


def chat_prompt(engine, messages):
    """The ids a conversation (api.ChatMessage list) is answered from, as chat_sft rendered it; a RequestError naming
    what breaks the conversation's rules."""
    plain = [m.plain() for m in messages]
    problem = prompt_problem(plain)
    if problem:
        raise RequestError(f"messages: {problem}", "messages")
    return render_prompt(engine.tokenizer, plain)


def parse_hops(engine, got, n_sup, corpus):
    if (got["text"] is None) == (got["seed"] is None):
        raise RequestError("hops: send text (a hops document) or seed (to draw one), not both", "text")
    text = got["text"]
    most = engine.model.config.sequence_len  # a query is at least a token: more could never fit the context
    if got["n_queries"] is not None and got["n_queries"] > most:
        raise RequestError(f"n_queries={got['n_queries']}: at most {most} (the model's context)", "n_queries")
    if got["seed"] is not None and not 0 <= got["seed"] < 2 ** 63:
        raise RequestError(f"seed={got['seed']}: must be from 0 to 2**63-1", "seed")
    if text is None:
        try:  # None: the corpus's own count; 0 is refused, not taken for the default
            text = corpus.draw(got["seed"], got["n_queries"])
        except ValueError as e:
            raise RequestError(f"n_queries: {e}", "n_queries") from None
    try:
        ids, answers = encode_hops(engine.tokenizer, text)
    except ValueError as e:
        raise RequestError(str(e), "text") from None
    check_length(ids[:-1], engine.model.config.sequence_len, "text")
    return Request("hops", ids, n_sup, text=text, answers=answers)


def check_length(ids, limit, name):
    if len(ids) > limit:
        raise RequestError(f"{name} is {len(ids)} tokens (with <|bos|>); the model's context is {limit} tokens", name)


def run_events(engine, req):
    """The request's events: generate yields one per token, then a summary; score and hops one result."""
    if req.mode == "generate":
        return generate(engine, req)
    return iter([(score if req.mode == "score" else hops)(engine, req)])


def token_namer(tokenizer):
    token_bytes = tokenizer.enc.decode_single_token_bytes
    return lambda token: token_bytes(token).decode("utf-8", errors="replace")


def halt_scores(model, halting, states, logits):
    """(n,) the rule's score after each step 1..n for one position, all steps in one call of the rule. states: y at
    steps 0 (the input) .. n; logits: (n + 1, V) of steps 0..n, or (n, V) of steps 1..n when the rule does not read
    logits."""
    previous, current = Draft(model, torch.stack(states[:-1])), Draft(model, torch.stack(states[1:]))
    if len(logits) == len(states):  # computed already: cached_property reads the instance dict first
        previous.__dict__["logits"], current.__dict__["logits"] = logits[:-1], logits[1:]
    return HALTING_RULES[halting.rule](model, previous, current)


def first_halt(scores, threshold):
    """The step at which a position halts: the first whose score is below threshold, else the last (as
    halting.forward_halting counts steps)."""
    return next((s for s, value in enumerate(scores, start=1) if value < threshold), len(scores))


@torch.inference_mode()
def generate(engine, req):
    """Yield one dict per generated token (see the module docstring), then a summary dict (object refinement.done)."""
    model, name = engine.model, token_namer(engine.tokenizer)
    idx, _ = left_pad([req.ids])
    idx = idx.to(engine.device)
    cache = engine.new_cache(1, idx.size(1) + req.max_tokens, req.n_sup)
    rng = torch.Generator(device=engine.device).manual_seed(req.seed) if req.seed is not None else None
    stops = engine.stop_tokens()
    tokens, halts, finish_reason = [], [], "length"
    for i in range(req.max_tokens):
        with engine.autocast():
            x = model.embed(idx, cache)
            ys = [y for y, _ in model.refine(idx, req.n_sup, cache, x=x)]
            final = model.head(ys[-1])[:, -1]  # as model.forward computes it, so sampling picks the engine's token
            # the other steps' (and the input's, if the rule reads it) in one matmul: one read of the head's weights
            states = [x[0, -1]] + [y[0, -1] for y in ys]
            others = states[:-1] if req.halting.rule == "kl" else states[1:-1]
            earlier = model.head(torch.stack(others)) if others else final[:0]
        cache.advance(idx.size(1))
        token = sample_next(final, req.temperature, req.top_k, req.top_p, rng)
        logits = torch.cat([earlier, final]).float()  # steps 1..n, after step 0's if the rule reads it
        probs = F.softmax(logits[len(logits) - req.n_sup:], dim=-1)
        best_p, best = probs.max(dim=-1)
        chosen_p = probs[:, token[0]]
        with engine.autocast():
            scores = halt_scores(model, req.halting, states, logits)
        t = token.item()
        halts.append(first_halt(scores.tolist(), req.halting.threshold))
        if t in stops:
            finish_reason = "stop"
            halts.pop()
            break
        tokens.append(t)
        steps = [{"id": b, "text": name(b), "prob": p, "chosen_prob": c}
                 for b, p, c in zip(best.tolist(), best_p.tolist(), chosen_p.tolist())]
        yield {"object": "refinement.token", "index": i, "id": t, "text": name(t), "steps": steps,
               "halt_step": halts[-1]}
        idx = token[:, None]
    summary = {"object": "refinement.done", "n_sup": req.n_sup, "halt": str(req.halting),
               "text": engine.tokenizer.decode(tokens), "finish_reason": finish_reason,
               "mean_halt_steps": sum(halts) / len(halts) if halts else None}
    if req.drafts:  # base_sample --show_steps: each step's greedy continuation, generated on its own
        drafts = step_drafts(engine, [req.ids], range(1, req.n_sup + 1), max_tokens=req.max_tokens, temperature=0.0,
                             top_k=req.top_k, seed=req.seed)
        summary["drafts"] = [engine.tokenizer.decode(rows[0]) for rows in drafts]
    yield summary


def step_drafts(engine, rows, steps, cancelled=None, **sampling):
    """Each step's own continuation of the prompts rows: for each s of steps, the rows generated alone at n_sup=s
    (engine.generate's sampling, the seed's generator drawn anew for each step, so a seeded draft at step s is what a
    request of n_sup=s gets): [[token ids per row] per step], end tokens left out. None once cancelled (a
    threading.Event) is set: it is checked at every token. Drafts for /v1/refinement and /v1/chat/completions."""
    drafts = []
    for s in steps:
        tokens = [[] for _ in rows]
        for column in engine.generate(rows, n_sup=s, **sampling):
            if cancelled is not None and cancelled.is_set():
                return None
            for out, token in zip(tokens, column):
                if token is not None:
                    out.append(token)
        drafts.append(tokens)
    return drafts


@torch.inference_mode()
def score(engine, req):
    """Each token's loss in nats at every step, teacher-forced: tokens[t] is predicted from the tokens before it."""
    name = token_namer(engine.tokenizer)
    idx = torch.tensor([req.ids[:-1]], device=engine.device)
    targets = torch.tensor([req.ids[1:]], device=engine.device)
    with engine.autocast():
        losses = engine.model(idx, targets, n_sup=req.n_sup, loss_reduction="none")[:, 0].float()
    return {"object": "refinement.score", "n_sup": req.n_sup, "tokens": [name(t) for t in req.ids[1:]],
            "losses": losses.tolist(), "mean_loss": losses.mean(dim=1).tolist()}


@torch.inference_mode()
def hops(engine, req):
    """Each query's predicted answer (argmax) and the right answer's probability at every step, and the accuracy
    per step by hop count (as nanochat.eval.hops_eval scores a corpus)."""
    model, name = engine.model, token_namer(engine.tokenizer)
    idx = torch.tensor([req.ids[:-1]], device=engine.device)
    positions = torch.tensor([i - 1 for i, _, _, _ in req.answers], device=engine.device)
    want = torch.tensor([t for _, _, t, _ in req.answers], device=engine.device)
    per_step = []
    with engine.autocast():
        for y, _ in model.refine(idx, req.n_sup):
            probs = F.softmax(model.head(model.apply_coda(y)[0, positions]).float(), dim=-1)
            per_step.append((probs.argmax(dim=-1).tolist(), probs.gather(1, want[:, None])[:, 0].tolist()))
    queries = []
    for q, (a, (_, h, t, _)) in enumerate(zip(hops_answers(req.text), req.answers)):
        steps = [{"text": name(best[q]), "correct": best[q] == t, "prob": p[q]} for best, p in per_step]
        queries.append({"offset": a.position, "hops": h, "answer": a.answer, "steps": steps})
    hop_counts = sorted({q["hops"] for q in queries})
    accuracy = [[sum(q["steps"][s]["correct"] for q in queries if q["hops"] == h) /
                 sum(q["hops"] == h for q in queries) for h in hop_counts] for s in range(req.n_sup)]
    return {"object": "refinement.hops", "n_sup": req.n_sup, "text": req.text, "queries": queries,
            "hops": hop_counts, "accuracy": accuracy}


def work(engine, req):
    """The request's work for a streaming.Worker: each event emitted as it is made; stops at the next event once
    cancelled."""
    def run(emit, cancelled):
        for item in run_events(engine, req):
            emit(item)
            if cancelled.is_set():
                return
    return run


def answer(items):
    """A non-streamed answer: generate's token events gathered into the summary as its tokens; else the one result."""
    if items[-1]["object"] == "refinement.done":
        return {**items[-1], "object": "refinement", "tokens": items[:-1]}
    return items[-1]
