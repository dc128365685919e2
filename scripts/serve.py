"""
Serve a checkpoint over OpenAI's completions API (FastAPI + uvicorn), on localhost by default.

pip install -e '.[serve]'
python -m scripts.serve --model_tag d12 --step best --port 8000 --max_concurrency 16
NANOCHAT_API_KEY=<secret> python -m scripts.serve --host 0.0.0.0 ...   # other machines: with a key

With a key (--api_key or NANOCHAT_API_KEY) every route but /health needs the header Authorization: Bearer <key>, as
at OpenAI and vLLM; without one, listening beyond loopback (--host 0.0.0.0) is refused unless --allow_no_auth. Key
or not, other sites' pages can neither use nor read it (Gate): bodies are JSON only, a Host that does not name the
server and an Origin other than its own are refused (--allowed_hosts, --allowed_origins widen this).

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
POST /v1/refinement   what each supervision step did, per token (generate, score a text, a hops document): the
                      fields and answers are in nanochat/serve/refinement.py and docs/serving.md
GET  /                the refinement viewer, a page that renders /v1/refinement (no key needed: it holds no data)
GET  /v1/models       the served model, named by its model tag
GET  /health          status, step, limits, generations running and the hops corpus the page draws from (no key
                      needed: for load balancers)
GET  /metrics         Prometheus text format: requests by route and status (every answer), failed generations, write
                      timeouts, prompt and completion tokens, histograms of latency, time to first token, time per
                      output token, supervision steps per token and requests per batch; queue depth, running

Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 a malformed or invalid request or a
Host that does not name the server (code "invalid_host"), 401 a missing or wrong API key (code "invalid_api_key"), 403
a web page of another origin (code "forbidden_origin"), 404 an unknown model or path, 413 a body over 1 MiB, 415 a body
that is not Content-Type: application/json, 503 every generation slot busy for --queue_timeout seconds. A client that
goes away stops its generation at the next token, and its slot is free again (/metrics counts its request as 499);
one that sends too slowly gets a 408 (--read_timeout), one that leaves its answer unread is dropped (--write_timeout).
"""

import argparse
import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import math
import os
import queue
import re
import socket
import struct
import sys
import threading
import time
import urllib.parse
import uuid

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

try:  # for unread_bytes: Linux's SIOCOUTQ
    import fcntl
    import termios
except ImportError:
    fcntl = termios = None

import torch
import torch.nn.functional as F

try:
    import h11
    import uvicorn
    from fastapi import FastAPI, Request, Security
    from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.routing import Match
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ModuleNotFoundError as e:
    sys.exit(f"error: the server needs {e.name}; install it with: pip install -e '.[serve]'")

from nanochat.checkpoint.manager import latest_model_tag, load_model
from nanochat.cli import ArgumentParser, ExitCode
from nanochat.common import autocast_for, autodetect_device_type, compute_init, default_dtype, device_available
from nanochat.files import model_tag_arg, step_arg
from nanochat.model.engine import Engine, ends_mid_character
from nanochat.model.halting import forward_halting
from nanochat.serve import refinement

MAX_BODY_BYTES = 1 << 20
READ_TIMEOUT_S, MAX_CONNECTIONS = 30.0, 256  # the flags' defaults: nginx reads headers and body in 60 s each
WRITE_TIMEOUT_S = 30.0  # --write_timeout's default: as nginx's send_timeout, from the client's last read
MAX_STOPS = 4  # as at OpenAI
CLIENT_GONE = 499  # nginx's status for a client that closed the connection before its answer (in /metrics)
MAX_LOGPROBS = 20  # as vLLM's default; OpenAI's is 5
PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of token-id lists, none of them empty"
# OpenAI's fields this server does not implement, and the values at which they change nothing
BOS_LOG_EVERY = 1000  # the log warns of prompts without <|bos|> at the first and then every this many
AUTO_HALTING = "kl:0.0005"  # what n_sup "auto" runs: Huginn's exit threshold on KL(p_s || p_{s-1})
NEUTRAL = {"best_of": 1, "suffix": "", "logit_bias": {}, "frequency_penalty": 0.0, "presence_penalty": 0.0}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a typo'd field or "5" for 5 is an error, as at OpenAI

    model: str | None = None
    prompt: object  # four forms, told apart (and refused in one sentence) by split_prompt
    max_tokens: int | None = Field(None, ge=0)  # None: 16, or the server's limit if lower
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] = []
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n_sup: int | str | None = None  # steps, or "auto" / "RULE:THRESHOLD" for per-token halting: see depth
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: nothing to do with it here
    echo: bool = False
    best_of: int = 1
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str = ""
    logit_bias: dict[str, float] = {}
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def null_means_default(cls, data):  # as at OpenAI, where every optional field is nullable
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class APIError(Exception):
    def __init__(self, status, message, param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status, message, param=None, code=None, headers=None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


def key_checker(api_key):
    """A FastAPI dependency that lets a request through only with the header Authorization: Bearer <api_key>, else
    a 401 in OpenAI's shape; compare_digest: how long the comparison takes says nothing about the key."""
    bearer = HTTPBearer(auto_error=False)  # a missing header is our 401, in OpenAI's shape, not FastAPI's 403
    expected = api_key.encode()

    async def check(credentials: HTTPAuthorizationCredentials | None = Security(bearer)):
        if credentials is None:
            raise APIError(401, "no API key: send the header Authorization: Bearer <key>, the key the server was "
                                "started with (--api_key or NANOCHAT_API_KEY)", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(credentials.credentials.encode(), expected):
            raise APIError(401, "incorrect API key: send the key the server was started with (--api_key or "
                                "NANOCHAT_API_KEY)", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


async def read_body(request):
    """The JSON object of a request, or a 4xx saying what is wrong with it."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":  # a form or text/plain POST is one a page of any other site may send
        got = f"its Content-Type is {json.dumps(media_type)}" if media_type else "it has no Content-Type"
        raise APIError(415, f"the body must be JSON sent with the header Content-Type: application/json, and {got} "
                            f"(curl: -H 'Content-Type: application/json')")
    body = b""
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:  # closed by the client, or by the read timeout (GuardedHTTP): no one to answer
        raise APIError(400, "the client closed the connection before the request body arrived") from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "request body nests too deeply to parse; a completions request nests 3 levels") from None


def field_path(loc):
    """A validation error's location as one line: a key holding a line break or another control character is quoted."""
    return ".".join(p if isinstance(p, str) and p.isprintable() else json.dumps(p) for p in loc)


def parse_request(obj):
    try:
        return CompletionRequest.model_validate(obj)
    except ValidationError as e:
        problems = "; ".join(f"{field_path(err['loc']) or 'body'}: {err['msg']}" for err in e.errors())
        param = field_path(e.errors()[0]["loc"][:1]) or None
        raise APIError(400, problems, param) from None


def is_token_ids(value):
    return isinstance(value, list) and len(value) > 0 and all(type(t) is int for t in value)  # bool is not an id


def split_prompt(prompt):
    """OpenAI's prompt forms -> a list of prompts, each a string or a list of token ids; an APIError if malformed."""
    if isinstance(prompt, str) or is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or
                                                all(is_token_ids(p) for p in prompt)):
        return prompt
    raise APIError(400, f"prompt must be {PROMPT_FORMS}", "prompt")


def token_offsets(token_bytes):
    """Where each token starts in the text the tokens decode to, in characters (counting a UTF-8 character at its
    first byte: a token that starts inside a character starts where that character does)."""
    offsets, chars = [], 0
    for piece in token_bytes:
        starts_inside = len(piece) > 0 and 0x80 <= piece[0] < 0xC0
        offsets.append(max(0, chars - starts_inside))
        chars += sum(not 0x80 <= b < 0xC0 for b in piece)
    return offsets


class StopMatcher:
    """Finds stop strings in text fed to it piece by piece, each character looked at once per stop (Knuth-Morris-
    Pratt): rescanning the text, or every prefix of a stop, per token costs the square of a long stop string."""

    def __init__(self, stops):
        self.stops, self.tables, self.states, self.fed = stops, None, [0] * len(stops), 0

    def feed(self, text):
        """Read text[self.fed:] (text grows by appending); returns where the earliest stop string found in it starts,
        or None."""
        if self.tables is None:  # built on first use, in the worker thread: a 1 MB stop takes a fraction of a second
            self.tables = [failure_table(stop) for stop in self.stops]
        found = None
        for j, (stop, table) in enumerate(zip(self.stops, self.tables)):
            k = self.states[j]
            for i in range(self.fed, len(text)):
                c = text[i]
                while k and stop[k] != c:
                    k = table[k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):
                    found = i + 1 - k if found is None else min(found, i + 1 - k)
                    break  # this stop's first occurrence: a later one cannot start earlier
            self.states[j] = k
        self.fed = len(text)
        return found

    def partial(self):
        """Length of the longest end of the fed text that begins a stop string: held back until it is known not to
        be one."""
        return max(self.states, default=0)


def failure_table(stop):
    """table[i]: the length of the longest proper prefix of stop[:i+1] that is also its suffix (KMP)."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[k] != stop[i]:
            k = table[k - 1]
        if stop[k] == stop[i]:
            k += 1
        table[i] = k
    return table


class Choice:
    """One completion's text as its tokens come, cut before the first stop string or the model's end token."""

    def __init__(self, tokenizer, stops, end_tokens=()):
        self.tokenizer, self.stops, self.end_tokens = tokenizer, stops, end_tokens
        self.tokens, self.text, self.finish_reason = [], "", None  # text: what has been handed out
        self.end_token = None  # the end token the model chose, if it chose one: not text, but scored
        self.matcher = StopMatcher(stops)

    def add(self, token, last):
        """The next token; returns the text that became final."""
        if token in self.end_tokens:
            self.end_token = token
        else:
            self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        # characters before a trailing U+FFFD are final; the U+FFFD may yet become a character split across tokens
        cut = self.matcher.feed(text if last or self.end_token is not None else text.rstrip("\ufffd"))
        if cut is not None or self.end_token is not None:
            return self.finish("stop", text[:cut])
        if last:
            return self.finish("length", text)
        if ends_mid_character(text):  # wait for the rest of the character
            return ""
        return self.finish(None, text[:len(text) - self.matcher.partial()])

    def finish(self, reason, text):
        piece, self.text, self.finish_reason = text[len(self.text):], text, reason
        return piece


class Job:
    """One request's rows (each prompt n times), generated by a worker thread that stops when cancelled is set;
    score(row, choice), if given, is each choice's logprobs, computed by the worker once generation is over; echo:
    each choice's text begins with its prompt's."""

    def __init__(self, prompts, rows, choices, columns, max_tokens, include_usage, score=None, echo=False):
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.prompts, self.rows, self.choices, self.columns = prompts, rows, choices, columns
        self.max_tokens, self.include_usage, self.score, self.echo = max_tokens, include_usage, score, echo
        self.cancelled = threading.Event()
        self.queue = asyncio.Queue()  # (index, piece, finish_reason) for streaming; None when the worker ends
        self.worker = None
        self.logprobs = [None] * len(choices)
        self.stats = {}  # the engine's stats of this generation (steps per token under halting)
        self.arrived = time.perf_counter()  # the handler sets it to when the request arrived, before any wait
        self.first_at = self.last_at = None  # when the first and the last token step ended
        self.steps_done = 0
        if max_tokens == 0:  # the prompt is scored, nothing generated
            for choice in choices:
                choice.finish("length", "")

    def run(self, emit):
        """Worker thread: generate, then score what was generated."""
        self.generate(emit)
        if self.score is not None and not self.cancelled.is_set():
            self.logprobs = [self.score(row, choice) for row, choice in zip(self.rows, self.choices)]

    def generate(self, emit):
        """Every row token by token, until each choice is finished or the job is cancelled."""
        try:
            for step, column in enumerate(self.columns):
                self.last_at, self.steps_done = time.perf_counter(), step + 1
                self.first_at = self.first_at or self.last_at
                if self.cancelled.is_set():
                    return
                for index, (choice, token) in enumerate(zip(self.choices, column)):
                    if choice.finish_reason is None:
                        piece = choice.add(token, last=step == self.max_tokens - 1)
                        if piece or choice.finish_reason:
                            emit((index, piece, choice.finish_reason))
                if all(choice.finish_reason for choice in self.choices):
                    return
        finally:
            self.columns.close()

    def usage(self):
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        completion_tokens = sum(len(choice.tokens) for choice in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


async def when_gone(request, then):
    """Call then() once the client has closed the connection (uvicorn answers receive() with http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    then()


class Batcher:
    """Requests generate together in one engine Batch, stepped token by token on a thread of its own (continuous
    batching): a waiting request that runs the batch's depth (n_sup and halting) joins it at the next token, and a
    finished one leaves at once, freeing its rows, so a long request holds no later one waiting. When the oldest
    waiting request runs another depth, no more join until the batch drains; then a batch of that depth starts."""

    DONE = object()  # the end of a request's columns

    def __init__(self, engine, observe=lambda size: None):
        self.engine, self.observe = engine, observe  # observe(requests in the batch), as each request joins
        self.pending = []  # [(engine.Request, its column queue, closed Event, its stats dict)]
        self.ready = threading.Condition()
        self.thread = None

    def submit(self, request, stats):
        """Queue a prepared request; returns the iterator of its columns (closing it drops the request)."""
        entry = (request, queue.Queue(), threading.Event(), stats)
        with self.ready:
            self.pending.append(entry)
            self.ready.notify()
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name="batcher", daemon=True)
                self.thread.start()
        return self.columns(entry)

    def columns(self, entry):
        _, columns, closed, _ = entry
        try:
            while (column := columns.get()) is not self.DONE:
                if isinstance(column, BaseException):
                    raise column
                yield column
        finally:
            closed.set()

    def take(self, batch):
        """The waiting requests that join this step: all of the batch's depth (a new batch takes the oldest's),
        none while the oldest waiting runs another depth."""
        with self.ready:
            while not self.pending and not batch:
                self.ready.wait()
            if not self.pending:
                return batch, []
            depth = lambda entry: (entry[0].n_sup, entry[0].halting)
            if not batch:
                batch = self.engine.new_batch(*depth(self.pending[0]))
            if depth(self.pending[0]) != (batch.n_sup, batch.halting):
                return batch, []
            joining = [e for e in self.pending if depth(e) == depth(self.pending[0])]
            self.pending = [e for e in self.pending if depth(e) != depth(self.pending[0])]
            return batch, joining

    def run(self):
        batch, entries = None, {}  # entries: each Member of the batch -> (its column queue, its closed Event)
        while True:
            batch, joining = self.take(batch)
            for request, out, closed, stats in joining:
                member = batch.add(request, stats)
                if member.finished:  # max_tokens 0: nothing to generate
                    out.put(self.DONE)
                    continue
                entries[member] = (out, closed)
                self.observe(len(batch))
            for member, (out, closed) in list(entries.items()):
                if closed.is_set():  # its client went away: its rows leave before this step
                    batch.drop(member)
                    out.put(self.DONE)
                    del entries[member]
            try:
                results = batch.step()
            except Exception as e:  # noqa: BLE001 - every request of the batch must learn of it, not the thread's log
                for out, _ in entries.values():
                    out.put(e)
                    out.put(self.DONE)
                batch, entries = None, {}
                continue
            for member, column in results:
                out, closed = entries[member]
                if not closed.is_set():
                    out.put(column)
                if member.finished:
                    out.put(self.DONE)
                    del entries[member]
            if not batch:
                batch = None  # drained: the next batch may run another depth


class Metrics:
    """The server's Prometheus metrics (prometheus_client), in a registry of the server's own (tests run several)."""

    def __init__(self, server):
        self.registry = registry = CollectorRegistry()
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.requests = Counter("nanochat_requests", "HTTP requests answered, by route and status (route \"other\": "
                                "an unknown path; \"(connection)\": answered by the connection's limits, 408 or 503; "
                                "499: the client left before its answer)", ["route", "status"], registry=registry)
        self.failed = Counter("nanochat_failed_generations", "Generations that failed (a 500, or an error event in a "
                              "stream already answered 200), by route", ["route"], registry=registry)
        self.write_timeouts = Counter("nanochat_write_timeouts", "Connections dropped because the client left an "
                                      "answer unread for --write_timeout seconds", registry=registry)
        self.prompt_tokens = Counter("nanochat_prompt_tokens", "Prompt tokens of completion requests served",
                                     registry=registry)
        self.completion_tokens = Counter("nanochat_completion_tokens", "Tokens generated", registry=registry)
        self.latency = Histogram("nanochat_request_latency_seconds", "From a completion request's arrival (queue "
                                 "wait included) to its last token", buckets=latency_buckets, registry=registry)
        self.first_token = Histogram("nanochat_time_to_first_token_seconds", "From a completion request's arrival "
                                     "to its first token", buckets=latency_buckets, registry=registry)
        self.per_token = Histogram("nanochat_time_per_output_token_seconds", "A request's decode time per token after "
                                   "the first", buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                                   registry=registry)
        self.steps = Histogram("nanochat_steps_per_token", "Supervision steps each generated token ran (fewer than "
                               "n_sup under halting)", buckets=range(1, server.most_steps + 1),
                               registry=registry)
        self.batch_requests = Histogram("nanochat_batch_requests", "Requests generating together in the batch, as "
                                        "each request joins it",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)
        Gauge("nanochat_queue_depth", "Completion requests waiting for a generation slot",
              registry=registry).set_function(lambda: server.waiting)
        Gauge("nanochat_running", "Generations running", registry=registry).set_function(lambda: server.running)

    def refused(self, status):
        """An answer the connection gave itself (GuardedHTTP): 408, 503, 400; 0: dropped by the write deadline."""
        if status:
            self.requests.labels(route="(connection)", status=str(status)).inc()
        else:
            self.write_timeouts.inc()

    def finished(self, job, n_sup):
        """Record a generation that ended; n_sup: the steps each token ran when no halting rule was on."""
        if not job.worker.cancelled() and job.worker.exception() is not None:
            self.failed.labels(route="/v1/completions").inc()
        tokens = sum(len(choice.tokens) for choice in job.choices)
        self.prompt_tokens.inc(sum(len(ids) for ids in job.prompts))
        self.completion_tokens.inc(tokens)
        end = time.perf_counter()
        self.latency.observe(end - job.arrived)
        if job.first_at is not None:
            self.first_token.observe(job.first_at - job.arrived)
        if job.steps_done > 1:
            self.per_token.observe((job.last_at - job.first_at) / (job.steps_done - 1))
        steps = [s for row in job.stats.get("steps", ()) for s in row] or [n_sup] * tokens
        for s in steps:
            self.steps.observe(s)


class Server:
    """The engine behind the endpoints: validates requests against the model and bounds concurrent generations."""

    def __init__(self, engine, info, max_concurrency=1, max_tokens_limit=None, queue_timeout=30.0, max_batch=8,
                 hops_corpus=None):
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
        self.slots = asyncio.Semaphore(max_concurrency)
        self.running = self.waiting = 0
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
        message = (f"{self.without_bos} token-id prompt(s) so far did not start with <|bos|> (id {self.bos}); the model "
                   f"was trained on text after it: prepend it (lm-eval local-completions: add_bos_token=True)")
        if self.without_bos == missing or self.without_bos // BOS_LOG_EVERY > (self.without_bos - missing) // BOS_LOG_EVERY:
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
        """A request's n_sup -> (steps or None for all, halting.Halting or None), or an APIError saying what is wrong."""
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

    async def acquire(self):
        """Take a generation slot: a free one at once, else wait up to queue_timeout seconds (0: no waiting)."""
        wait = self.queue_timeout if self.slots.locked() else None
        self.waiting += 1
        try:
            await asyncio.wait_for(self.slots.acquire(), timeout=wait)
        except asyncio.TimeoutError:
            raise APIError(503, f"server busy: {self.max_concurrency} generations running; retry later",
                           code="server_busy") from None
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self, _=None):
        self.running -= 1
        self.slots.release()

    def start(self, req, prompts):
        """Take a slot and start the request's generation in a worker thread; the slot is freed when it ends."""
        rows = [ids for ids in prompts for _ in range(req.n)]  # choice index = prompt index * n + j, as at OpenAI
        stats = {}
        n_sup, halting = self.depth(req.n_sup)
        # the end tokens are Choice's to spot, so that logprobs can score the one the model chose
        request = self.engine.prepare(rows, max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                                      top_p=req.top_p, n_sup=n_sup, seed=req.seed, halt=halting,
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
        loop = asyncio.get_running_loop()
        emit = (lambda item: loop.call_soon_threadsafe(job.queue.put_nowait, item)) if req.stream else (lambda _: None)
        job.worker = asyncio.ensure_future(run_in_threadpool(job.run, emit))
        job.worker.add_done_callback(self.release)
        job.worker.add_done_callback(lambda _: self.metrics.finished(job, n_sup or self.config.n_sup_inference))
        job.worker.add_done_callback(lambda _: job.queue.put_nowait(None))
        return job

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

    def last_events(self, job):
        """What ends a stream: an error event if the generation failed, else the usage (if asked for) and [DONE]."""
        if job.worker.exception() is not None:  # counted by Metrics.finished
            error = {"message": f"generation failed: {job.worker.exception()}", "type": "server_error"}
            return f"data: {json.dumps({'error': error})}\n\n"
        usage = f"data: {json.dumps(self.chunk(job, [], job.usage()))}\n\n" if job.include_usage else ""
        return usage + "data: [DONE]\n\n"

    async def events(self, job):
        """Server-sent events as the text comes; a generation that fails mid-stream ends with an error event."""
        try:
            ended = False
            while not ended:
                # every event ready goes in one write: the await between writes lets a closed connection be noticed
                # before the next (asyncio logs "socket.send() raised exception." from the fifth write after)
                items = [await job.queue.get()]
                while not job.queue.empty():
                    items.append(job.queue.get_nowait())
                ended = None in items
                pieces = items[:items.index(None)] if ended else items
                events = [f"data: {json.dumps(self.chunk(job, [self.piece(*item)]))}\n\n" for item in pieces]
                if ended:
                    events.append(self.last_events(job))
                yield "".join(events)
        finally:
            job.cancelled.set()  # the client left mid-stream: stop generating


class GuardedHTTP(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a read deadline per request, a write deadline, a cap on open connections and
    no Nagle delay: uvicorn has none of them (its keep-alive timeout starts after a response, --limit-concurrency
    answers only once a request's headers arrive, and a client that stops reading is waited for forever), so a client
    sending slowly, or never reading, held a connection forever. Subclassed by guarded_http."""
    read_timeout, write_timeout, max_connections = READ_TIMEOUT_S, WRITE_TIMEOUT_S, MAX_CONNECTIONS
    refused = staticmethod(lambda status: None)  # told the status of every answer given here, not by the app

    def connection_made(self, transport):
        super().connection_made(transport)
        self.deadline = self.write_deadline = self.unread_watch = None
        self.dropped = False
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets it only on sockets made with proto IPPROTO_TCP, and socket.create_server's are proto 0:
            # without it a response's second write waits ~40 ms for the client's delayed ACK (Nagle's algorithm)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # pause as soon as anything waits in user space (the kernel's buffers are full: the client is not reading),
        # so that the write deadline runs from then, and a response cannot complete with bytes still queued here
        transport.set_write_buffer_limits(high=0)
        if len(self.connections) > self.max_connections:
            self.refuse(503, "Service Unavailable", f"server busy: {self.max_connections} connections open "
                                                    f"(--max_connections); retry later")
        else:
            self.arm()

    def data_received(self, data):
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):  # the request is all here
            self.disarm()
        else:
            self.arm()  # a request (a keep-alive connection's next one, too) began: it has read_timeout to arrive

    def connection_lost(self, exc):
        self.disarm()
        self.stop_write_deadline()
        if self.unread_watch is not None:
            self.unread_watch.cancel()
        super().connection_lost(exc)

    def on_response_complete(self):
        super().on_response_complete()
        if self.unread_watch is None and not self.transport.is_closing() and unread_bytes(self.transport):
            # answers the kernel still holds: a client that sends small requests slowly and never reads would take
            # hours to fill the buffers (the write deadline's trigger), so watch that it reads at all
            self.unread, self.read_at = unread_bytes(self.transport), self.loop.time()
            self.unread_watch = self.loop.call_later(self.write_timeout / 4, self.check_unread)

    def check_unread(self):
        """Drop the client if the bytes waiting for it have not gone down for write_timeout; stop watching once
        none wait."""
        self.unread_watch, unread, now = None, unread_bytes(self.transport), self.loop.time()
        if not unread or self.dropped:
            return
        if unread < self.unread:  # it read some
            self.read_at = now
        self.unread = unread
        if now - self.read_at >= self.write_timeout:
            self.write_timed_out()
        else:
            self.unread_watch = self.loop.call_later(self.write_timeout / 4, self.check_unread)

    def pause_writing(self):
        super().pause_writing()
        if self.write_deadline is None:  # the client must read within write_timeout, or be dropped
            self.write_deadline = self.loop.call_later(self.write_timeout, self.write_timed_out)

    def resume_writing(self):
        super().resume_writing()
        self.stop_write_deadline()

    def stop_write_deadline(self):
        if self.write_deadline is not None:
            self.write_deadline.cancel()
            self.write_deadline = None

    def write_timed_out(self):
        self.write_deadline = None
        if not self.dropped:  # the unread-bytes watch and the write deadline may both fire before the loss is seen
            self.dropped = True
            self.refused(0)  # no status: nothing more can reach the client
        self.transport.abort()  # close() would wait for the unread bytes to be sent: forever

    def send_400_response(self, msg):  # a request h11 cannot parse
        self.refused(400)
        super().send_400_response(msg)

    def arm(self):
        if self.deadline is None:
            self.deadline = self.loop.call_later(self.read_timeout, self.timed_out)

    def disarm(self):
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def timed_out(self):
        self.deadline = None
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no answer to this request has begun
            self.refuse(408, "Request Timeout", f"the request did not arrive within {self.read_timeout:g} s "
                                                f"(--read_timeout)")
        elif not self.transport.is_closing():  # answered already (a 400 before its body ended), or answering
            self.transport.close()

    def refuse(self, status, reason, message):
        self.refused(status)
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                     "server_error", "param": None, "code": None}}).encode()
        if not self.transport.is_closing():
            self.transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: "
                                 f"{len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
            self.transport.close()


def unread_bytes(transport):
    """Bytes the kernel holds for the client, not sent yet or not acknowledged (Linux's SIOCOUTQ); 0 where it cannot
    say (another system, a socket gone)."""
    sock = transport.get_extra_info("socket")
    if sock is None or termios is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except (OSError, ValueError):
        return 0


def guarded_http(read_timeout=READ_TIMEOUT_S, max_connections=MAX_CONNECTIONS, write_timeout=WRITE_TIMEOUT_S,
                 refused=None):
    """The protocol class uvicorn.Config(http=...) takes, with these limits; refused(status) counts the answers the
    protocol gives itself (408, 503, an unparsable request's 400; 0 for a client dropped by the write deadline)."""
    limits = {"read_timeout": read_timeout, "max_connections": max_connections, "write_timeout": write_timeout}
    if refused is not None:
        limits["refused"] = staticmethod(refused)
    return type("GuardedHTTP", (GuardedHTTP,), limits)


def host_name(value):
    """The name or address a Host header (or an Origin's authority) names, lower case, without port, brackets or a
    trailing dot, and its port (None when not given); (None, None) when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, closed, rest = value[1:].partition("]")
        port = rest[1:] if closed and rest.startswith(":") else None
        if not closed or rest and port is None:
            return None, None
    else:
        name, colon, port = value.partition(":")
        port = port if colon else None
    if port is not None and not (port.isascii() and port.isdigit() and int(port) < 65536):
        return None, None
    return name.rstrip(".") or None, None if port is None else int(port)


def plain_name(name):
    """A name or address as Host headers give it once parsed: an IPv6 address may come without brackets here."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return host_name(name)[0]


def addresses(host):
    """The IP addresses host names (an address names itself); empty when it does not resolve."""
    try:
        return {ipaddress.ip_address(info[4][0].split("%")[0]) for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return set()


class HostCheck:
    """Which Host headers name this server: its --host (and the addresses it resolves to), loopback names and
    addresses when it listens on loopback, any address and this machine's names when it listens on all interfaces,
    and --allowed_hosts ("*": any, "*.example": its subdomains). A page on attacker.example whose name was rebound to
    127.0.0.1 sends Host: attacker.example, so it is refused (DNS rebinding)."""

    def __init__(self, bound, allowed=()):
        self.bound, self.any = bound, "*" in allowed
        self.suffixes = tuple(name[1:].lower() for name in allowed if name.startswith("*."))  # .example
        self.names = {plain_name(name) for name in [bound, *allowed] if not name.startswith("*")}
        bound_addresses = addresses(bound)
        self.names |= {str(a) for a in bound_addresses}
        self.loopback = bool(bound_addresses) and all(a.is_loopback for a in bound_addresses)
        self.everywhere = any(a.is_unspecified for a in bound_addresses)
        if self.everywhere:
            self.names |= {socket.gethostname().lower(), socket.getfqdn().lower()}

    def allows(self, name):
        if self.any or name in self.names or name.endswith(self.suffixes):
            return True
        if (self.loopback or self.everywhere) and (name == "localhost" or name.endswith(".localhost")):
            return True  # RFC 6761: a browser resolves *.localhost to this machine, never to another
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False
        # an address is no name to rebind: any of the machine's, when it listens on all of them
        return str(address) in self.names or self.everywhere or self.loopback and address.is_loopback


def same_origin(origin, host, allowed):
    """Whether a request's Origin header is the server's own (the Host it was sent to) or one of --allowed_origins."""
    if "*" in allowed or origin.strip().lower().rstrip("/") in allowed:
        return True
    parts = urllib.parse.urlsplit(origin.strip())
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    name, port = host_name(parts.netloc)
    own_name, own_port = host_name(host)
    return default is not None and name is not None and (name, port or default) == (own_name, own_port or default)


SECURITY_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY")]


def page_policy(path):
    """The viewer's Content-Security-Policy: its own inline script and style (by hash) and requests to this server
    only; nothing else runs or loads, whatever markup reached the page, and no other site may frame it."""
    with open(path, encoding="utf-8") as f:
        page = f.read()
    digest = lambda tag: " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(m.encode()).digest()).decode()}'"
                                  for m in re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.DOTALL))
    return (f"default-src 'none'; script-src {digest('script')}; style-src {digest('style')}; connect-src 'self'; "
            f"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


PAGE_POLICY = page_policy(refinement.PAGE)


class Gate:
    """ASGI middleware in front of every route: refuses a request whose Host header does not name this server (DNS
    rebinding), or that a web page of another origin sent (browsers say whose in Origin); counts every answer by
    route and status in /metrics; adds SECURITY_HEADERS. Inside Starlette's error middleware, which answers an
    exception's 500 after it passed through here: it is counted on its way out."""

    def __init__(self, app, metrics, hosts, origins):
        self.app, self.metrics, self.hosts = app, metrics, hosts
        self.origins = {origin.strip().lower().rstrip("/") for origin in origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, started = self.route(scope), []

        async def counted(message):
            if message["type"] == "http.response.start":
                started.append(True)
                self.metrics.requests.labels(route=route, status=str(message["status"])).inc()
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        refusal = self.refusal(dict((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]))
        try:
            await (refusal or self.app)(scope, receive, counted)
        except Exception:
            if not started:
                self.metrics.requests.labels(route=route, status="500").inc()
            raise

    def route(self, scope):
        """The route's path as the app declares it (/v1/models/{model}), or "other": a label per path that was sent
        would let clients grow /metrics without bound."""
        for route in getattr(scope.get("app"), "routes", ()):  # Starlette puts itself in the scope
            if route.matches(scope)[0] != Match.NONE:
                return route.path
        return "other"

    def refusal(self, headers):
        """An error response for a request that must not be served here, or None."""
        host = headers.get("host")
        name = host_name(host)[0] if host is not None else None
        if host is not None and not (name is not None and self.hosts.allows(name)):
            return error_response(400, f"the Host header {json.dumps(host)} does not name this server "
                                       f"(--host={self.hosts.bound}); send the address it listens on, or start it "
                                       f"with --allowed_hosts={name or 'NAME'} to serve that name too",
                                  code="invalid_host")
        origin = headers.get("origin")
        if origin is not None and not same_origin(origin, host or "", self.origins):
            return error_response(403, f"a web page of another origin ({origin}) may not use this server: a page "
                                       f"elsewhere must not make it generate or read its answers; start it with "
                                       f"--allowed_origins={origin} to allow that page", code="forbidden_origin")
        return None


def create_app(server, api_key=None, host="127.0.0.1", allowed_hosts=(), allowed_origins=()):
    """The FastAPI app; with api_key every route but /health needs it (FastAPI's own docs pages are off: they could
    not send it, and the API is OpenAI's, documented above). host: the address it listens on, which the Host header
    must name (HostCheck), or one of allowed_hosts; a browser's Origin must be the server's own or allowed_origins."""
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
    async def health():
        return server.health()

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
        await server.acquire()
        try:
            job = server.start(req, prompts)
        except BaseException:
            server.release()
            raise
        job.arrived = arrived
        watcher = asyncio.ensure_future(when_gone(request, job.cancelled.set))
        job.worker.add_done_callback(lambda _: watcher.cancel())
        if req.stream:
            return StreamingResponse(server.events(job), media_type="text/event-stream", headers=headers)
        await asyncio.shield(job.worker)  # if this handler is cancelled, the slot stays taken until the thread ends
        if job.cancelled.is_set():  # the client left: no one reads the answer, but /metrics says so
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(server.completion(job), headers=headers)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def viewer():  # the page holds no data and asks for the key itself, so it needs none
        return FileResponse(refinement.PAGE, media_type="text/html", headers={"Content-Security-Policy": PAGE_POLICY})

    @app.post("/v1/refinement", dependencies=keyed)
    async def refine(request: Request):  # what each supervision step did: see nanochat/serve/refinement.py
        body = await read_body(request)
        try:  # tokenizing off the event loop, as completions do
            req = await run_in_threadpool(refinement.parse_request, server.engine, body, server.max_tokens_limit,
                                          AUTO_HALTING, server.hops_corpus)
        except refinement.RequestError as e:
            raise APIError(400, str(e), e.param) from None
        await server.acquire()
        events = refinement.threaded(refinement.run(server.engine, req), server.release)
        failed = server.metrics.failed.labels(route="/v1/refinement").inc
        if req.stream:
            return StreamingResponse(refinement.sse(events, failed), media_type="text/event-stream")
        # a client that leaves stops the generation at its next token, and frees the slot, as completions do
        collecting = asyncio.ensure_future(refinement.collect(events))
        watcher = asyncio.ensure_future(when_gone(request, collecting.cancel))
        try:
            await asyncio.wait({collecting})
        finally:
            watcher.cancel()
            collecting.cancel()  # a no-op once done; else this handler was cancelled: stop the generation too
        if collecting.cancelled():
            return Response(status_code=CLIENT_GONE)
        try:
            return JSONResponse(collecting.result())
        except Exception:
            failed()
            raise

    return app


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help gives each flag's default, unless its help says it already (a default that is not a value)."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


def number_arg(kind):
    """argparse type: an int or float, written in ASCII (int() and float() also read other scripts' digits)."""
    def parse(value):
        if not value.isascii():
            raise argparse.ArgumentTypeError(f"{value!r}: write the number in ASCII digits 0-9")
        return kind(value)

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return parse


def names_arg(value):
    """argparse type of a comma-separated list of names: empty items dropped."""
    return [name.strip() for name in value.split(",") if name.strip()]


def parse_args(argv=None):
    parser = ArgumentParser(description="Serve a checkpoint over OpenAI's completions API",
                            formatter_class=DefaultsHelp)
    parser.add_argument("--model_tag", type=model_tag_arg, default=None,
                        help="checkpoint tag (default: the most recently written)")
    parser.add_argument("--step", type=step_arg, default="latest", help="'latest', 'best' (lowest val bpb) or N")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=number_arg(int), default=8000, help="port to listen on; 0 = any free port")
    parser.add_argument("--max_concurrency", type=number_arg(int), default=16,
                        help="requests generating at once, batched together (each forward serves them all); more "
                             "wait up to --queue_timeout")
    parser.add_argument("--queue_timeout", type=number_arg(float), default=30.0,
                        help="seconds a request waits for a busy slot (0: answer 503 at once when all are busy)")
    parser.add_argument("--max_tokens_limit", type=number_arg(int), default=None,
                        help="largest max_tokens (default: context)")
    parser.add_argument("--max_batch", type=number_arg(int), default=8,
                        help="most completions per request (prompts x n)")
    parser.add_argument("--read_timeout", type=number_arg(float), default=READ_TIMEOUT_S,
                        help="seconds a request's headers and body may take to arrive; then 408 and the connection "
                             "closes (a slow client no longer holds one forever)")
    parser.add_argument("--write_timeout", type=number_arg(float), default=WRITE_TIMEOUT_S,
                        help="seconds a client may leave its answers unread once its receive window is full (the "
                             "server's bytes for it stop going down); then the connection is dropped (a client that "
                             "never reads no longer holds one forever)")
    parser.add_argument("--max_connections", type=number_arg(int), default=MAX_CONNECTIONS,
                        help="open connections at most; one more is answered 503 and closed")
    parser.add_argument("--device_type", default=None, help="cuda|cpu|mps (default: autodetect)")
    parser.add_argument("--api_key", default=None,
                        help="every request but /health must send Authorization: Bearer <key> (default: "
                             "$NANOCHAT_API_KEY; a flag's value shows in ps, the variable does not)")
    parser.add_argument("--allowed_hosts", type=names_arg, default=[],
                        help="comma-separated names the Host header may give besides the --host address ('*': any), "
                             "e.g. the name a reverse proxy serves this under; others get a 400 (DNS rebinding; "
                             "default: none)")
    parser.add_argument("--allowed_origins", type=names_arg, default=[],
                        help="comma-separated origins (https://app.example) whose web pages may call this server; "
                             "a browser's request from any other site gets a 403 ('*': any; default: none)")
    parser.add_argument("--allow_no_auth", action="store_true",
                        help="serve a non-loopback --host without an API key (anyone who can connect may use it)")
    args = parser.parse_args(argv)
    args.api_key = args.api_key or os.environ.get("NANOCHAT_API_KEY") or None  # empty: no key
    if args.api_key and not (args.api_key.isascii() and args.api_key.isprintable() and " " not in args.api_key):
        parser.error("the API key (--api_key or NANOCHAT_API_KEY) must be printable ASCII without spaces, as an HTTP "
                     "header carries it")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port={args.port}: must be from 1 to 65535 (or 0 for any free port)")
    if not (args.queue_timeout >= 0 and math.isfinite(args.queue_timeout)):
        parser.error(f"--queue_timeout={args.queue_timeout}: must be a number of seconds >= 0")
    for name in ("read_timeout", "write_timeout"):
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            parser.error(f"--{name}={getattr(args, name)}: must be a number of seconds > 0")
    for name in ("max_concurrency", "max_batch", "max_tokens_limit", "max_connections"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name}={value}: must be >= 1")
    args.device_type = args.device_type or autodetect_device_type()
    if not device_available(args.device_type):
        parser.error(f"--device_type={args.device_type} is not available on this machine")
    return args


def build_server(args):
    """(uvicorn.Server, Server) for parsed args; the caller runs it on a socket it bound."""
    model_tag = args.model_tag or latest_model_tag()
    device = compute_init(args.device_type)[4]  # TF32 matmuls on CUDA, as in training
    model, tokenizer, meta = load_model(model_tag, args.step, device)
    info = {"model_tag": model_tag, "step": meta["step"]}
    dtype = default_dtype(args.device_type)  # bf16 matmuls and KV cache on GPU
    engine = Engine(model, tokenizer, autocast=lambda: autocast_for(args.device_type, dtype))
    server = Server(engine, info, args.max_concurrency, args.max_tokens_limit, args.queue_timeout,
                    args.max_batch, refinement.trained_hops_corpus(meta))
    app = create_app(server, args.api_key, args.host, args.allowed_hosts, args.allowed_origins)
    http = guarded_http(args.read_timeout, args.max_connections, args.write_timeout, server.metrics.refused)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off", http=http)
    return uvicorn.Server(config), server


def is_loopback(host):
    """Whether every address host names is a loopback one, so that only this machine can connect."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):  # not resolvable: the listen fails later, saying so
        return False
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def auth_problem(args):
    """Why the server must not start with these flags (None when it may): reachable from other machines, no key."""
    if args.api_key or args.allow_no_auth or is_loopback(args.host):
        return None
    return (f"--host={args.host} can be reached from other machines and no API key is set: set NANOCHAT_API_KEY (or "
            f"--api_key) to require one, or pass --allow_no_auth to serve anyone who can connect")


def listen(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def main(argv=None):
    args = parse_args(argv)
    problem = auth_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        sock = listen(args.host, args.port)  # before the model loads: a taken port fails in a second, not a minute
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {os.strerror(e.errno) if e.errno else e}; pick another --port "
              f"(0 = any free port)", file=sys.stderr)
        return ExitCode.USAGE
    with sock:
        try:
            http, server = build_server(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return ExitCode.USAGE
        host, port = sock.getsockname()[:2]
        base = f"http://{f'[{host}]' if ':' in host else host}:{port}"  # an IPv6 address goes in brackets in a URL
        print(f"serving {server.model_id} step {server.info['step']} at {base}/v1 (OpenAI completions API; "
              f"max_concurrency={args.max_concurrency}; {'API key required' if args.api_key else 'no API key'}); "
              f"the refinement viewer: {base}/", flush=True)
        try:
            http.run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down cleanly, then may re-raise the signal
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
