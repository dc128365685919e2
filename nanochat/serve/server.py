"""The server behind the routes: Server checks requests against the model, bounds concurrent generations and
starts them on the batcher; create_app is the FastAPI app with every route.

POST /v1/completions  OpenAI's completions request: model (default: the served one), prompt (a string, a list of
                      strings, a list of token ids, or a list of token-id lists: a string gets <|bos|> first, token
                      ids are used as given), max_tokens (16; 0 with echo scores the prompt only), temperature (1),
                      top_p, n, stop (a string or up to 4), seed, stream, stream_options.include_usage, user, echo
                      (the prompt's text and, with logprobs, its tokens before the completion's), logprobs (0..20:
                      each token's log-probability and the top ones, not with stream); extras: top_k, n_sup
                      (supervision steps, 1..4x n_sup_train, default n_sup_inference: the log-probabilities are that
                      step's;
                      or per-token adaptive halting within all of them: "auto" (AUTO_HALTING) or a rule
                      "RULE:THRESHOLD" such as "kl:0.0005", each token's log-probabilities from the step it halted at).
                      best_of, suffix, logit_bias, frequency_penalty and presence_penalty are accepted at their
                      defaults only: another value would change the answer in a way this server does not implement.
                      Any other field is a 400, as at OpenAI.
                      -> {id, object: "text_completion", created, model, choices: [{text, index, logprobs,
                      finish_reason: "stop"|"length"}], usage: {prompt_tokens, completion_tokens, total_tokens}};
                      logprobs: null, or {tokens, token_logprobs (null for the first prompt token), top_logprobs
                      (the likeliest tokens and the chosen one), text_offset}; a completion the model ended lists its
                      end token last. With stream, server-sent events of the same shape, one per piece of text, then
                      data: [DONE].
POST /v1/chat/completions  OpenAI's chat request: messages (system or developer, then user and assistant in turn, the
                      user first and last; content a string or text parts), rendered as chat_sft trained on them
                      (nanochat/data/chat.py) and answered until <|assistant_end|>; max_tokens or
                      max_completion_tokens (default: the server's limit), and temperature, top_p, n, stop, seed,
                      stream, stream_options, user as completions take them; extras top_k, n_sup (steps, "auto" or
                      "RULE:THRESHOLD", as completions) and drafts (a JSON boolean: each choice's reply at every step
                      too, Server.drafts). logprobs, logit_bias and the penalties at their defaults only.
                      -> {id: "chatcmpl-...", object: "chat.completion", created, model, choices: [{index,
                      message: {role: "assistant", content}, logprobs: null, finish_reason, with drafts: drafts, a
                      text per step}], usage, n_sup: the steps each token ran, or the halting rule}; with stream,
                      chat.completion.chunk events: each choice's delta {role: "assistant", content: ""} first, then
                      the text as it comes; with drafts one chunk of every choice's drafts (an empty delta) before
                      the usage's; then data: [DONE]. The same slots, batching, key and limits as completions.
POST /v1/refinement   what each supervision step did, per token (generate, score a text, a hops document): the
                      fields and answers are in nanochat/serve/refinement.py and docs/serving.md
GET  /                the refinement viewer, a page that renders /v1/refinement (no key needed: it holds no data)
GET  /v1/models       the served model, named by its model tag
GET  /health          status, step, limits, generations running and the hops corpus the page draws from; with
                      --api_key, a caller without the key gets {"status": "ok"} alone (liveness, for load balancers)
                      and one with a wrong key a 401
GET  /metrics         Prometheus text format: requests by route and status (every answer), failed generations, write
                      timeouts, prompt and completion tokens, histograms of latency, time to first token, time per
                      output token, supervision steps per token and requests per batch; queue depth, running

Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 a malformed or invalid request or a
Host that does not name the server (code "invalid_host"), 401 a missing or wrong API key (code "invalid_api_key"), 403
a web page of another origin (code "forbidden_origin"), 404 an unknown model or path, 413 a body over 1 MiB, 415 a
body that is not Content-Type: application/json, 503 every generation slot busy, or the client's share of them
(--max_concurrency_per_client), for --queue_timeout seconds, or the connection over its caps (--max_connections,
--max_connections_per_client). A client that goes away stops its generation at the next token, and its slot is free
again (/metrics counts its request as 499); one that sends too slowly gets a 408 (--header_timeout for its headers,
--read_timeout for all of it), one that leaves its answer unread is dropped (--write_timeout).
"""

import json
import random
import sys
import time

import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request, Security
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from nanochat.data.chat import prompt_problem, render_prompt
from nanochat.model.halting import forward_halting
from nanochat.serve import refinement
from nanochat.serve.api import (
    AUTO_HALTING,
    CHAT_NEUTRAL,
    MAX_STOPS,
    NEUTRAL,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_response,
    parse_refinement,
    parse_request,
    read_body,
    split_prompt,
    token_offsets,
)
from nanochat.serve.batcher import Batcher, Job
from nanochat.serve.http import Gate, HostCheck, key_checker, key_holder, page_policy, request_client
from nanochat.serve.prometheus import Metrics
from nanochat.serve.slots import Busy, Slots
from nanochat.serve.stops import Choice
from nanochat.serve.streaming import Worker

CLIENT_GONE = 499  # nginx's status for a client that closed the connection before its answer (in /metrics)


# OpenAI's fields this server does not implement, and the values at which they change nothing
BOS_LOG_EVERY = 1000  # the log warns of prompts without <|bos|> at the first and then every this many


class Server:
    """The engine behind the endpoints: validates requests against the model and bounds concurrent generations, in all
    (max_concurrency) and per client (max_concurrency_per_client; default: no cap but the total), shared fairly
    (slots.Slots)."""

    def __init__(self, engine, info, max_concurrency=1, max_tokens_limit=None, queue_timeout=30.0, max_batch=8,
                 hops_corpus=None, max_concurrency_per_client=None):
        self.engine, self.info = engine, info
        self.model_id, self.created = info["model_tag"], int(time.time())
        self.config = engine.model.config
        self.most_steps = engine.most_steps = refinement.most_steps(self.config)  # past the trained steps, as base_loss
        self.hops_corpus = hops_corpus or refinement.HopsCorpus()  # the model's own (trained_hops_corpus), or default
        self.max_concurrency, self.max_batch = max_concurrency, max_batch
        self.max_tokens_limit = max_tokens_limit or self.config.sequence_len
        self.vocab_size = min(self.config.vocab_size, engine.tokenizer.get_vocab_size())  # ids both can read
        if self.config.sequence_len + self.max_tokens_limit > engine.model.rotary_seq_len:
            raise ValueError(f"max_tokens_limit={self.max_tokens_limit}: a full-context prompt plus that many tokens "
                             f"exceeds the model's {engine.model.rotary_seq_len} positions")
        self.queue_timeout = queue_timeout
        self.slots = Slots(max_concurrency, max_concurrency_per_client)
        self.bos = engine.tokenizer.get_bos_token_id()
        self.without_bos = 0  # token-id prompts that did not start with <|bos|>: see bos_warning
        self.metrics = Metrics(self)
        self.batcher = Batcher(engine, self.metrics.batch_requests.observe)

    def health(self):
        return {"status": "ok", **self.info, "sequence_len": self.config.sequence_len,
                "n_sup_max": self.most_steps, "n_sup_inference": self.config.n_sup_inference,
                "n_sup_train": self.config.n_sup_train, "max_tokens_limit": self.max_tokens_limit,
                "max_batch": self.max_batch, "running": self.running, "max_concurrency": self.max_concurrency,
                "prompts_without_bos": self.without_bos, "hops_corpus": self.hops_corpus.describe()}

    def bos_warning(self, req, prompts):
        """A warning (also logged, the first time and every BOS_LOG_EVERY-th) when a token-id prompt does not start
        with <|bos|>: the model only saw text after it, so such log-likelihoods differ from lm-eval's hf backend's
        (lm-eval's local-completions needs add_bos_token=True). None when every prompt is fine."""
        token_prompts = [p for text, p in zip(split_prompt(req.prompt), prompts) if not isinstance(text, str)]
        missing = sum(p[0] != self.bos for p in token_prompts)
        if not missing:
            return None
        self.without_bos += missing
        message = (f"{self.without_bos} token-id prompt(s) so far did not start with <|bos|> (id {self.bos}); the "
                   f"model was trained on text after it: prepend it (lm-eval local-completions: add_bos_token=True)")
        before = self.without_bos - missing
        if before == 0 or self.without_bos // BOS_LOG_EVERY > before // BOS_LOG_EVERY:
            print(f"warning: {message}", file=sys.stderr, flush=True)
        return message

    def model_card(self):
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "nanochat-trm"}

    def check(self, req):
        """Prompt token ids of a valid request (defaults filled in), or an APIError naming what is wrong."""
        if req.model is not None and req.model != self.model_id:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_id!r}", "model",
                           "model_not_found")
        for name, neutral in NEUTRAL.items():
            if getattr(req, name) != neutral:
                raise APIError(400, f"{name}={getattr(req, name)!r} is not supported by this server; leave it out or "
                                    f"send {json.dumps(neutral)}", name)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", "stream_options")
        if req.stream and (req.echo or req.logprobs is not None):
            raise APIError(400, "echo and logprobs are not supported with stream: true here; send stream: false",
                           "echo" if req.echo else "logprobs")
        req.stop = [req.stop] if isinstance(req.stop, str) else req.stop
        if len(req.stop) > MAX_STOPS or "" in req.stop:
            raise APIError(400, f"stop: up to {MAX_STOPS} non-empty strings", "stop")
        texts = split_prompt(req.prompt)
        if len(texts) * req.n > self.max_batch:  # counted before tokenizing: 200,000 prompts took a second
            raise APIError(400, f"{len(texts)} prompt(s) x n={req.n} completions exceeds this server's limit of "
                                f"{self.max_batch} (--max_batch)", "n")
        ids = [self.engine.encode_prompt(p) if isinstance(p, str) else p for p in texts]
        bad = next((t for p in ids for t in p if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is not in the model's vocabulary (0 to "
                                f"{self.vocab_size - 1})", "prompt")
        longest = max(len(p) for p in ids)
        if longest > self.config.sequence_len:
            raise APIError(400, f"prompt is {longest} tokens (a string's count includes <|bos|>); the model's context "
                                f"is {self.config.sequence_len} tokens", "prompt")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens=0 generates nothing; send echo: true with it to score the prompt, or "
                                "max_tokens >= 1", "max_tokens")
        req.max_tokens = min(16, self.max_tokens_limit) if req.max_tokens is None else req.max_tokens
        if req.max_tokens > self.max_tokens_limit:
            raise APIError(400, f"max_tokens={req.max_tokens} exceeds this server's limit of "
                                f"{self.max_tokens_limit}", "max_tokens")
        self.depth(req.n_sup)
        return ids

    def depth(self, n_sup):
        """A request's n_sup -> (steps or None for all, halting.Halting or None), or an APIError saying what is
        wrong."""
        most = self.most_steps
        if n_sup is None or isinstance(n_sup, int) and 1 <= n_sup <= most:
            return n_sup, None
        if isinstance(n_sup, int):
            raise APIError(400, f"n_sup={n_sup}: must be from 1 to {most} ({refinement.STEPS_PAST_TRAINING}x the "
                                f"{self.config.n_sup_train} supervision steps the model was trained with)", "n_sup")
        try:
            return None, self.engine.check_halt(AUTO_HALTING if n_sup == "auto" else n_sup)
        except ValueError as e:
            raise APIError(400, f"n_sup={n_sup!r}: an integer from 1 to {most}, \"auto\", or {e}", "n_sup") from None

    @property
    def running(self):
        return self.slots.busy

    @property
    def waiting(self):
        return len(self.slots.waiters)

    async def acquire(self, client):
        """Take a generation slot for client (http.client_key): a free one at once, else wait up to queue_timeout
        seconds (0: no waiting) for the slots to give it one."""
        try:
            await self.slots.acquire(client, self.queue_timeout)
        except Busy as e:
            self.metrics.busy.labels(reason=e.reason).inc()
            raise APIError(503, str(e), code="server_busy") from None

    def release(self, client):
        self.slots.release(client)

    def check_chat(self, req):
        """(a completions request of a chat request, its prompt ids): the conversation rendered as chat_sft trained
        on it, every other field checked as completions checks it; or an APIError naming what is wrong."""
        for name, neutral in CHAT_NEUTRAL.items():
            if getattr(req, name) != neutral:
                raise APIError(400, f"{name}={getattr(req, name)!r} is not supported by this server; leave it out or "
                                    f"send {json.dumps(neutral)}", name)
        if None not in (req.max_tokens, req.max_completion_tokens) and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ: send one of them", "max_tokens")
        messages = [m.plain() for m in req.messages]
        problem = prompt_problem(messages)
        if problem:
            raise APIError(400, f"messages: {problem}", "messages")
        ids = render_prompt(self.engine.tokenizer, messages)
        if len(ids) > self.config.sequence_len:
            raise APIError(400, f"messages: the conversation is {len(ids)} tokens as the model reads it; its context "
                                f"is {self.config.sequence_len} tokens", "messages")
        fields = {k: getattr(req, k) for k in ("model", "temperature", "top_p", "top_k", "n", "stop", "seed",
                                                "stream", "stream_options", "n_sup", "user")}
        completion = CompletionRequest.model_validate({**fields, "prompt": ids, "max_tokens": req.max_tokens or
                                                       req.max_completion_tokens or self.max_tokens_limit})
        return completion, self.check(completion)

    def chat_completion(self, job, n_sup):
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                    "finish_reason": c.finish_reason, **self.choice_drafts(job, i)} for i, c in enumerate(job.choices)]
        return {**self.chat_chunk(job, choices, job.usage(), "chat.completion"), "n_sup": self.steps_run(n_sup)}

    @staticmethod
    def choice_drafts(job, index):
        """The extension field of a choice asked for its drafts: {"drafts": its reply at step 1, 2, ...}."""
        return {} if job.drafts is None else {"drafts": job.drafts[index]}

    def chat_chunk(self, job, choices, usage=None, kind="chat.completion.chunk"):
        return {"id": job.id, "object": kind, "created": job.created, "model": self.model_id, "choices": choices,
                "usage": usage}

    def chat_events(self, job, n_sup):
        """chat.completion.chunk events: each choice's role alone first (with empty content, as OpenAI sends it), then
        its text as it comes, the steps run on its last; then, if asked for, one chunk of every choice's drafts (an
        empty delta, the extension field drafts) and one of the usage (no choices)."""
        def piece(index, delta, finish_reason=None):
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

        def event(item):
            index, text, finish_reason = item
            chunk = self.chat_chunk(job, [piece(index, {"content": text}, finish_reason)])
            return {**chunk, "n_sup": self.steps_run(n_sup)} if finish_reason else chunk

        def last():
            drafts = [] if job.drafts is None else [self.chat_chunk(job, [
                {**piece(i, {}), **self.choice_drafts(job, i)} for i in range(len(job.choices))])]
            return drafts + ([self.chat_chunk(job, [], job.usage())] if job.include_usage else [])
        roles = [self.chat_chunk(job, [piece(i, {"role": "assistant", "content": ""})])
                 for i in range(len(job.choices))]
        return job.worker.events(event, last, first=roles)

    def steps_run(self, n_sup):
        """What a request's n_sup ran, for the answer: the steps, or the halting rule ("kl:0.0005")."""
        steps, halting = self.depth(n_sup)
        return str(halting) if halting else steps or self.config.n_sup_inference

    def start(self, req, prompts, client=None, route="/v1/completions", drafts=False):
        """Start the request's generation on a worker thread (its slot taken, freed when it ends); client: the HTTP
        request, watched so that a client that leaves stops it, and whose slot it holds; route: the one /metrics
        counts a failure under; drafts: then each choice's reply at every step too (Server.drafts), in the same slot."""
        rows = [ids for ids in prompts for _ in range(req.n)]  # choice index = prompt index * n + j, as at OpenAI
        stats = {}
        n_sup, halting = self.depth(req.n_sup)
        seed = req.seed
        if drafts and seed is None:  # one seed for the reply and every draft: they differ by their steps, not by luck
            seed = random.getrandbits(63)
        # the end tokens are Choice's to spot, so that logprobs can score the one the model chose
        request = self.engine.prepare(rows, max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                                      top_p=req.top_p, n_sup=n_sup, seed=seed, halt=halting,
                                      stop_tokens=())  # checks its arguments now
        columns = self.batcher.submit(request, stats)
        end_tokens = self.engine.stop_tokens()
        choices = [Choice(self.engine.tokenizer, req.stop, end_tokens) for _ in rows]
        score = None
        if req.logprobs is not None:
            score = lambda prompt, choice: self.logprobs(prompt, choice, req.logprobs, req.echo, n_sup, halting)
        job = Job(prompts, rows, choices, columns, req.max_tokens,
                  req.stream_options is not None and req.stream_options.include_usage, score, req.echo)
        job.stats = stats
        if drafts:
            job.draft = lambda job, cancelled: self.drafts(job, req, seed, n_sup, halting, cancelled)
        steps = n_sup or self.config.n_sup_inference
        key = request_client(client)
        release = lambda _: self.release(key)  # noqa: E731
        job.worker = Worker(job.run, (release, lambda worker: self.metrics.finished(job, steps, worker.error(),
                                                                                     route)), client)
        return job

    def drafts(self, job, req, seed, n_sup, halting, cancelled):
        """Each choice's reply at every step 1..N, as a request of n_sup=s with the same seed and sampling gets it
        (refinement.step_drafts), cut at the stop strings as the reply is; N: the steps the request ran, whose draft
        is the reply itself, or under halting (a reply that is no one step's) the most it may run, every step
        generated. None once cancelled."""
        most = n_sup or self.config.n_sup_inference
        drafts = refinement.step_drafts(self.engine, job.rows, range(1, most if halting is None else most + 1),
                                        cancelled, max_tokens=req.max_tokens, temperature=req.temperature,
                                        top_k=req.top_k, top_p=req.top_p, seed=seed)
        if drafts is None:
            return None
        return [[self.draft_text(rows[i], req.stop) for rows in drafts] + ([] if halting else [choice.text])
                for i, choice in enumerate(job.choices)]

    def draft_text(self, tokens, stop):
        """A draft's text as a reply's would be: cut before its first stop string (Choice)."""
        choice = Choice(self.engine.tokenizer, stop)
        for i, token in enumerate(tokens):
            choice.add(token, last=i == len(tokens) - 1)
            if choice.finish_reason:
                break
        return choice.text

    def next_token_logprobs(self, ids, n_sup, halting=None):
        """(len(ids), V) float32: log-probabilities of the token after each prefix of ids, at step n_sup, or with
        halting at the step each position halted at (what generation with that halting computes)."""
        model, idx = self.engine.model, torch.tensor([ids], device=self.engine.device)
        with torch.inference_mode(), self.engine.autocast():
            if halting is None:
                logits = model(idx, n_sup=n_sup)[0]
            else:
                cache = self.engine.new_cache(1, len(ids), self.config.n_sup_inference)
                logits = forward_halting(model, idx, halting, cache)[0][0]
        return F.log_softmax(logits.float(), dim=-1).cpu()

    def logprobs(self, prompt, choice, top, echo, n_sup, halting=None):
        """OpenAI's logprobs of a choice: its tokens (the prompt's first if echo), each one's log-probability, the
        top likeliest tokens with the chosen one, and where each starts in the text (echo: from the prompt's)."""
        token_bytes = self.engine.tokenizer.enc.decode_single_token_bytes
        name = lambda token: token_bytes(token).decode("utf-8", errors="replace")
        ids = prompt + self.scored_completion(choice)
        lp = self.next_token_logprobs(ids, n_sup, halting)
        token_logprobs, top_logprobs = [], []
        for t in range(0 if echo else len(prompt), len(ids)):
            if t == 0:  # nothing before the first token to predict it from
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            values, indices = lp[t - 1].topk(top)
            token_logprobs.append(lp[t - 1, ids[t]].item())
            top_logprobs.append({**{name(i): v for i, v in zip(indices.tolist(), values.tolist())},
                                 name(ids[t]): token_logprobs[-1]})
        first = len(ids) - len(token_logprobs)
        return {"tokens": [name(t) for t in ids[first:]], "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": token_offsets(map(token_bytes, ids))[first:]}

    def scored_completion(self, choice):
        """The completion tokens that made the choice's text (a stop string may cut the last ones off), and the end
        token the model chose, if it chose one."""
        if choice.end_token is not None:
            return choice.tokens + [choice.end_token]
        if choice.text == self.engine.tokenizer.decode(choice.tokens):
            return choice.tokens
        offsets = token_offsets(map(self.engine.tokenizer.enc.decode_single_token_bytes, choice.tokens))
        return [t for t, offset in zip(choice.tokens, offsets) if offset < len(choice.text)]

    def chunk(self, job, choices, usage=None):
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": self.model_id,
                "choices": choices, "usage": usage}

    def completion(self, job):
        tokenizer = self.engine.tokenizer
        choices = [{"text": (tokenizer.decode(prompt) if job.echo else "") + c.text, "index": i, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}
                   for i, (prompt, c, logprobs) in enumerate(zip(job.rows, job.choices, job.logprobs))]
        return self.chunk(job, choices, job.usage())

    @staticmethod
    def piece(index, text, finish_reason):
        return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}

    def events(self, job):
        """Server-sent events as the text comes; then the usage, if asked for."""
        last = lambda: [self.chunk(job, [], job.usage())] if job.include_usage else []  # noqa: E731
        return job.worker.events(lambda item: self.chunk(job, [self.piece(*item)]), last)


PAGE_POLICY = page_policy(refinement.PAGE)


def create_app(server, api_key=None, host="127.0.0.1", allowed_hosts=(), allowed_origins=()):
    """The FastAPI app; with api_key every route needs it but the page and /health's liveness (FastAPI's own docs
    pages are off: they could not send it, and the API is OpenAI's, documented above). host: the address it listens
    on, which the Host header must name (HostCheck), or one of allowed_hosts; a browser's Origin must be the server's
    own or allowed_origins."""
    app = FastAPI(title="nanochat-TRM", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Gate, metrics=server.metrics, hosts=HostCheck(host, allowed_hosts), origins=allowed_origins)
    keyed = [Security(key_checker(api_key))] if api_key else []  # every route's but /health's dependencies

    @app.exception_handler(APIError)
    async def api_error(request, e):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e):  # unknown paths and methods, in OpenAI's error shape too
        return error_response(e.status_code, str(e.detail))

    @app.get("/health")
    async def health(holds_key: bool = Security(key_holder(api_key))):
        # liveness for anyone (a load balancer's probe sends no key); the model, its limits and its load only to a
        # caller that could use them anyway: one with the key, when the server has one
        return server.health() if holds_key else {"status": "ok"}

    @app.get("/metrics", dependencies=keyed)
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model}", dependencies=keyed)
    async def model(model: str):
        if model != server.model_id:
            raise APIError(404, f"model {model!r} does not exist; this server serves {server.model_id!r}", "model",
                           "model_not_found")
        return server.model_card()

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request):
        arrived = time.perf_counter()
        req = parse_request(await read_body(request))
        prompts = await run_in_threadpool(server.check, req)  # tokenizing a 1 MiB prompt takes ~0.1 s: not on the loop
        warning = server.bos_warning(req, prompts)
        headers = {"X-Nanochat-Warning": warning} if warning else None
        await server.acquire(request_client(request))
        try:
            job = server.start(req, prompts, request)
        except BaseException:
            server.release(request_client(request))
            raise
        job.arrived = arrived
        if req.stream:
            return StreamingResponse(server.events(job), media_type="text/event-stream", headers=headers)
        if await job.worker.finished() is None:  # the client left: no one reads the answer, but /metrics says so
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(server.completion(job), headers=headers)

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: Request):
        arrived = time.perf_counter()
        req = parse_request(await read_body(request), ChatCompletionRequest)
        completion, prompts = await run_in_threadpool(server.check_chat, req)  # rendering off the loop, as above
        await server.acquire(request_client(request))
        try:
            job = server.start(completion, prompts, request, route="/v1/chat/completions", drafts=req.drafts)
        except BaseException:
            server.release(request_client(request))
            raise
        job.id, job.arrived = "chat" + job.id, arrived
        if completion.stream:
            return StreamingResponse(server.chat_events(job, completion.n_sup), media_type="text/event-stream")
        if await job.worker.finished() is None:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(server.chat_completion(job, completion.n_sup))

    @app.api_route("/", methods=["GET", "HEAD"])
    async def viewer():  # the page holds no data and asks for the key itself, so it needs none
        return FileResponse(refinement.PAGE, media_type="text/html", headers={"Content-Security-Policy": PAGE_POLICY})

    @app.post("/v1/refinement", dependencies=keyed)
    async def refine(request: Request):  # what each supervision step did: see nanochat/serve/refinement.py
        body = parse_refinement(await read_body(request))
        try:  # tokenizing off the event loop, as completions do
            req = await run_in_threadpool(refinement.check_request, server.engine, body, server.max_tokens_limit,
                                          AUTO_HALTING, server.hops_corpus)
        except refinement.RequestError as e:
            raise APIError(400, str(e), e.param) from None
        client = request_client(request)
        await server.acquire(client)
        failed = lambda worker: worker.error() and server.metrics.failed.labels(route="/v1/refinement").inc()  # noqa: E731
        worker = Worker(refinement.work(server.engine, req), (lambda _: server.release(client), failed), request)
        if req.stream:
            return StreamingResponse(worker.events(lambda item: item), media_type="text/event-stream")
        items = await worker.finished()  # a client that leaves stops the generation at its next token, as above
        return Response(status_code=CLIENT_GONE) if items is None else JSONResponse(refinement.answer(items))

    return app
