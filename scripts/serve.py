"""
Serve a checkpoint over HTTP (FastAPI + uvicorn), on localhost by default.

python -m scripts.serve --model_tag d12 --step best --port 8000 --max_concurrency 2

GET  /health           -> {"status": "ok", "model_tag", "step", "sequence_len", "n_sup_max", "running", ...}
POST /v1/completions   {"prompt": str, "max_tokens": null (64 or the limit), "temperature": 1.0, "top_k": null,
                        "n_sup": null, "seed": null, "stream": false}
    -> {"completion", "prompt_tokens", "completion_tokens", "finish_reason": "stop"|"length", "n_sup"}
    with "stream": true, server-sent events: data: {"text": ...} per piece, then data: {"finish_reason", ...}
    and data: [DONE].

Bad requests get a 4xx with {"detail": message}: 400 malformed body (not UTF-8, not JSON), 413 body too large,
422 invalid fields (prompt longer than the context, max_tokens over the limit, negative temperature, ...),
503 when every generation slot stays busy for --queue_timeout seconds.
"""

import asyncio
import itertools
import json
import sys

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from nanochat.checkpoint_manager import latest_model_tag, load_model
from nanochat.cli import ArgumentParser
from nanochat.common import autodetect_device_type, device_available
from nanochat.engine import Engine, decode_stream
from scripts.base_sample import step_arg

MAX_BODY_BYTES = 1 << 20


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a typo'd field or "5" for 5 is an error, not a guess

    prompt: str
    max_tokens: int | None = Field(None, ge=1)  # None: 64, or the server's limit if lower
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1)
    n_sup: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stream: bool = False


async def read_body(request):
    """The JSON object of a request, or a 4xx saying what is wrong with it."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise HTTPException(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPException(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise HTTPException(400, f"request body is not valid JSON: {e}") from None


def parse_request(obj):
    try:
        return CompletionRequest.model_validate(obj)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise HTTPException(422, problems) from None


class Server:
    """The engine behind the endpoints: validates requests against the model and bounds concurrent generations."""

    def __init__(self, engine, info, max_concurrency=1, max_tokens_limit=None, queue_timeout=30.0):
        self.engine, self.info = engine, info
        self.config = engine.model.config
        self.max_concurrency = max_concurrency
        self.max_tokens_limit = max_tokens_limit or self.config.sequence_len
        if self.config.sequence_len + self.max_tokens_limit > engine.model.rotary_seq_len:
            raise ValueError(f"max_tokens_limit={self.max_tokens_limit}: a full-context prompt plus that many tokens "
                             f"exceeds the model's {engine.model.rotary_seq_len} positions")
        self.queue_timeout = queue_timeout
        self.slots = asyncio.Semaphore(max_concurrency)
        self.running = 0

    def health(self):
        return {"status": "ok", **self.info, "sequence_len": self.config.sequence_len,
                "n_sup_max": self.config.n_sup_inference, "max_tokens_limit": self.max_tokens_limit,
                "running": self.running, "max_concurrency": self.max_concurrency}

    def check(self, req):
        """Prompt token ids for a request (its max_tokens defaulted), or a 422 naming the limit it breaks."""
        ids = self.engine.encode_prompt(req.prompt)
        if len(ids) > self.config.sequence_len:
            raise HTTPException(422, f"prompt is {len(ids)} tokens (with <|bos|>); the model's context is "
                                     f"{self.config.sequence_len} tokens")
        if req.max_tokens is None:
            req.max_tokens = min(64, self.max_tokens_limit)
        if req.max_tokens > self.max_tokens_limit:
            raise HTTPException(422, f"max_tokens={req.max_tokens} exceeds this server's limit of "
                                     f"{self.max_tokens_limit}")
        if req.n_sup is not None and req.n_sup > self.config.n_sup_inference:
            raise HTTPException(422, f"n_sup={req.n_sup}: must be from 1 to {self.config.n_sup_inference}")
        return ids

    async def acquire(self):
        try:
            await asyncio.wait_for(self.slots.acquire(), timeout=self.queue_timeout)
        except asyncio.TimeoutError:
            raise HTTPException(503, f"server busy: {self.max_concurrency} generations running; retry later") from None
        self.running += 1

    def release(self):
        self.running -= 1
        self.slots.release()

    def tokens(self, ids, req):
        """The completion's token ids, lazily; generate() checks its arguments now, not in a worker thread."""
        columns = self.engine.generate([ids], max_tokens=req.max_tokens, temperature=req.temperature,
                                       top_k=req.top_k, n_sup=req.n_sup, seed=req.seed)
        return itertools.takewhile(lambda token: token is not None, (column[0] for column in columns))

    def summary(self, ids, req, n_tokens):
        n_sup = req.n_sup or self.config.n_sup_inference
        return {"prompt_tokens": len(ids), "completion_tokens": n_tokens, "n_sup": n_sup,
                "finish_reason": "length" if n_tokens == req.max_tokens else "stop"}

    def complete(self, ids, req):
        tokens = list(self.tokens(ids, req))
        return {"completion": self.engine.tokenizer.decode(tokens), **self.summary(ids, req, len(tokens))}

    async def events(self, ids, req):
        """Server-sent events as the tokens come; the slot is released however the stream ends (client gone too)."""
        try:
            counted = []
            tokens = (counted.append(t) or t for t in self.tokens(ids, req))
            async for piece in iterate_in_threadpool(decode_stream(self.engine.tokenizer, tokens)):
                yield f"data: {json.dumps({'text': piece})}\n\n"
            yield f"data: {json.dumps(self.summary(ids, req, len(counted)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.release()


async def prepend(first, rest):
    yield first
    async for item in rest:
        yield item


def create_app(server):
    app = FastAPI(title="nanochat-TRM")

    @app.get("/health")
    async def health():
        return server.health()

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(await read_body(request))
        ids = server.check(req)
        await server.acquire()
        if req.stream:
            events = server.events(ids, req)
            first = await anext(events)  # started, its finally releases the slot however the response ends
            return StreamingResponse(prepend(first, events), media_type="text/event-stream")
        try:
            return await run_in_threadpool(server.complete, ids, req)  # the event loop keeps answering /health
        finally:
            server.release()

    return app


def parse_args(argv=None):
    parser = ArgumentParser(description="Serve a checkpoint over HTTP")
    parser.add_argument("--model_tag", default=None, help="checkpoint tag (default: the most recently written)")
    parser.add_argument("--step", type=step_arg, default="latest", help="'latest', 'best' (lowest val bpb) or N")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: localhost only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max_concurrency", type=int, default=1, help="generations running at once")
    parser.add_argument("--queue_timeout", type=float, default=30.0, help="seconds a request waits for a slot")
    parser.add_argument("--max_tokens_limit", type=int, default=None, help="largest max_tokens (default: context)")
    parser.add_argument("--device_type", default=None, help="cuda|cpu|mps (default: autodetect)")
    args = parser.parse_args(argv)
    if args.max_concurrency < 1:
        parser.error(f"--max_concurrency={args.max_concurrency}: must be >= 1")
    if args.max_tokens_limit is not None and args.max_tokens_limit < 1:
        parser.error(f"--max_tokens_limit={args.max_tokens_limit}: must be >= 1")
    args.device_type = args.device_type or autodetect_device_type()
    if not device_available(args.device_type):
        parser.error(f"--device_type={args.device_type} is not available on this machine")
    return args


def build_server(args):
    """(uvicorn.Server, Server) for parsed args; the caller runs it (tests run it on a socket they bound)."""
    model_tag = args.model_tag or latest_model_tag()
    model, tokenizer, meta = load_model(model_tag, args.step, torch.device(args.device_type))
    info = {"model_tag": model_tag, "step": meta["step"]}
    server = Server(Engine(model, tokenizer), info, args.max_concurrency, args.max_tokens_limit, args.queue_timeout)
    config = uvicorn.Config(create_app(server), host=args.host, port=args.port, log_level="warning")
    return uvicorn.Server(config), server


def main(argv=None):
    args = parse_args(argv)
    try:
        http, server = build_server(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving step {server.info['step']} on http://{args.host}:{args.port} "
          f"(max_concurrency={args.max_concurrency})", flush=True)
    http.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
