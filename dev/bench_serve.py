"""
Load benchmark of scripts/serve.py on 127.0.0.1: requests/s, tokens/s, latency, time to first token, time per
output token, errors and server RSS.

OMP_NUM_THREADS=1 python -m dev.bench_serve --concurrency 1,4,16,64 --requests 64 --level_seconds 60

It starts `python -m scripts.serve` as a subprocess on loopback with a random API key (the clients send it), serving
--model_tag from $NANOCHAT_BASE_DIR, or by default the tests' tiny checkpoint trained into a temporary directory (a
few seconds). For each concurrency level, that many clients send --requests completions in all, stopping early after
--level_seconds: streaming and non-streaming in turn, token-id prompts of three lengths (a tenth, half and nine
tenths of the model's context). A 503 is expected once --max_concurrency generations run and a request waits
--queue_timeout seconds; any other error (another status, a broken stream, a timeout, a malformed answer) is a defect:
the table is printed and the exit code is 1. RSS is the server process's resident memory, from /proc (Linux).
tokens/s counts the completion tokens of the requests served (their usage), over the level's wall time; time per
output token (TPOT) is a streamed request's (latency - time to first token) / (tokens - 1), as vLLM's benchmark has it.
--connections reused,new runs each level once per kind of connection: each client keeping its connection alive (as
the openai client does), or opening a new one per request; time to first token differs between them where the
server's small writes wait for the client's delayed ACK (Nagle's algorithm).

Halting against every step, on the same prompts and seeds (issue 37): --n_sup all,kl:0.1 runs each level once per
depth, and the table gains the depth, the mean supervision steps a generated token ran (the server's /metrics) and,
with --score N, the answer bpb: N held-out windows of the corpus under $NANOCHAT_BASE_DIR, each sent with echo and
logprobs (max_tokens 0) at that depth, bits per byte of their last --max_tokens tokens. With --score, the load's
prompts are held-out text too (the windows' starts), not random tokens.

One client beside heavy ones (issue 56): --heavy 16 runs, instead of the levels, 16 clients that loop HEAVY for
--level_seconds from 127.0.0.1, while one client from --short_address (another loopback address: another client to
the server) sends SHORT, a chat request for 4 tokens, one after another; it prints the short request's latency
(p50, p99, max) and the tokens/s of all (heavy and short, over the wall time). The heavy request asks for 128 tokens:
the tiny checkpoint's server needs --max_tokens_limit 128.

OMP_NUM_THREADS=1 python -m dev.bench_serve --heavy 16 --level_seconds 60 --max_tokens_limit 128
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import secrets
import select
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx
import numpy as np

from nanochat.cli import ExitCode
from nanochat.files import get_base_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = "503 server_busy"  # the one error kind a bounded server is meant to give under load
HEAVY = {"prompt": "x", "max_tokens": 128, "n": 8, "n_sup": 8}  # issue 56's: 8 rows of 128 tokens at 8 steps
SHORT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}  # an honest chat request


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Load benchmark of scripts/serve.py on loopback")
    parser.add_argument("--model_tag", default=None, help="a checkpoint under $NANOCHAT_BASE_DIR (default: the "
                                                          "tests' tiny checkpoint, trained into a temporary directory)")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level (at most)")
    parser.add_argument("--level_seconds", type=float, default=60.0,
                        help="no new request of a level starts after this many seconds")
    parser.add_argument("--max_tokens", type=int, default=16, help="tokens per completion (capped by the server)")
    parser.add_argument("--max_concurrency", type=int, default=None, help="the server's --max_concurrency "
                                                                          "(default: the server's default)")
    parser.add_argument("--queue_timeout", type=float, default=None, help="the server's --queue_timeout (default: "
                                                                          "the server's default)")
    parser.add_argument("--max_tokens_limit", type=int, default=None, help="the server's --max_tokens_limit "
                                                                           "(default: the server's default)")
    parser.add_argument("--request_timeout", type=float, default=60.0, help="client timeout of one request (s)")
    parser.add_argument("--heavy", type=int, default=0, help="instead of the levels: this many clients loop HEAVY "
                        "while one client from --short_address sends SHORT again and again (see above)")
    parser.add_argument("--short_address", default="127.0.0.2",
                        help="the loopback address the short client connects from (127.0.0.1: the heavy clients')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_sup", default="all", help="comma-separated depths, each run at every level on the same "
                        "prompts and seeds: all (the model's), a number of steps, or RULE:THRESHOLD to halt per token "
                        "(docs/serving.md)")
    parser.add_argument("--connections", default="reused,new",
                        help="comma-separated: reused (each client keeps its connection alive) and/or new (a new "
                             "connection per request); each level runs once per kind")
    parser.add_argument("--score", type=int, default=0, help="score this many held-out windows of the corpus at "
                        "each depth (answer bpb); needs --model_tag and its corpus under $NANOCHAT_BASE_DIR")
    args = parser.parse_args(argv)
    args.depths = [None if d == "all" else int(d) if d.isdigit() else d for d in args.n_sup.split(",")]
    args.kinds = args.connections.split(",")
    if not args.kinds or not set(args.kinds) <= {"reused", "new"}:
        parser.error(f"--connections={args.connections}: write reused, new or reused,new")
    if args.score < 0 or args.score and args.model_tag is None:
        parser.error("--score N needs N >= 0 and a --model_tag trained on the corpus under $NANOCHAT_BASE_DIR")
    try:
        args.levels = [int(n) for n in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency={args.concurrency}: write comma-separated integers, such as 1,4,16")
    if args.heavy < 0:
        parser.error(f"--heavy={args.heavy}: must be >= 1, or 0 for the levels")
    if min(args.levels) < 1 or args.requests < 1 or args.max_tokens < 1 or args.level_seconds <= 0:
        parser.error("--concurrency levels, --requests and --max_tokens must be >= 1, --level_seconds > 0")
    return args


def rss_mib(pid):
    """Resident memory of process pid in MiB, or None where /proc is not there to read it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return kib / 1024


@contextlib.contextmanager
def server(base_dir, model_tag, api_key, args):
    """`python -m scripts.serve` on 127.0.0.1 and a free port; yields (process, base URL)."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": base_dir, "NANOCHAT_API_KEY": api_key,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "scripts.serve", "--model_tag", model_tag, "--host", "127.0.0.1", "--port", "0",
           "--device_type", "cpu"]
    cmd += [] if args.max_concurrency is None else ["--max_concurrency", str(args.max_concurrency)]
    cmd += [] if args.queue_timeout is None else ["--queue_timeout", str(args.queue_timeout)]
    cmd += [] if getattr(args, "max_tokens_limit", None) is None else ["--max_tokens_limit", str(args.max_tokens_limit)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not select.select([proc.stdout], [], [], 0.5)[0]:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"error: the server did not start: {proc.communicate()[1].strip()}")
        line = proc.stdout.readline()
        if " at http://" not in line:
            proc.kill()
            raise SystemExit(f"error: the server did not start: {line.strip()} {proc.communicate()[1].strip()}")
        yield proc, line.split(" at ")[1].split()[0].removesuffix("/v1")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


async def one_request(client, body):
    """(error kind or None, latency s, time to first token s or None, completion tokens) of one completion request;
    a streamed body asks for the usage chunk, which gives the tokens."""
    start = time.perf_counter()
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return f"{r.status_code} {r.json().get('error', {}).get('code')}", time.perf_counter() - start, None, 0
        answer = r.json()
        choices = answer.get("choices")
        ok = isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0].get("text"), str)
        return ((None if ok else "malformed answer"), time.perf_counter() - start, None,
                answer.get("usage", {}).get("completion_tokens", 0))
    first, done, tokens = None, False, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return f"{r.status_code} {r.json().get('error', {}).get('code')}", time.perf_counter() - start, None, 0
        async for line in r.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {"error": line}
            if "error" in chunk:
                return "broken stream", time.perf_counter() - start, first, tokens
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None:
                first = time.perf_counter() - start
    return (None if done else "stream without [DONE]"), time.perf_counter() - start, first, tokens


async def run_level(base_url, api_key, concurrency, prompts, args, n_sup=None, connections="reused"):
    """Every request of one concurrency level at one depth (n_sup None: the model's), on kept-alive connections
    (reused) or a new one per request (new): a list of (error kind or None, latency, ttft, streamed, completion
    tokens), and seconds."""
    depth = {} if n_sup is None else {"n_sup": n_sup}
    bodies = [{"prompt": prompts[i % len(prompts)], "max_tokens": args.max_tokens, "temperature": 1.0,
               "seed": i, "stream": i % 2 == 1, **depth,
               **({"stream_options": {"include_usage": True}} if i % 2 else {})}
              for i in range(args.requests)]
    results, started = [], time.perf_counter()
    keep = concurrency if connections == "reused" else 0  # 0: every connection closes after its request
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=keep)
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, limits=limits,
                                 timeout=args.request_timeout) as client:
        pending = iter(bodies)

        async def worker():
            for body in pending:  # one iterator shared by every worker: each body is sent once
                if time.perf_counter() - started > args.level_seconds:
                    return
                try:
                    error, latency, ttft, tokens = await one_request(client, body)
                except httpx.HTTPError as e:
                    error, latency, ttft, tokens = type(e).__name__, None, None, 0
                results.append((error, latency, ttft, body["stream"], tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - started


async def timed_post(client, path, body):
    """(error kind or None, latency s, completion tokens) of one non-streamed request."""
    start = time.perf_counter()
    try:
        r = await client.post(path, json=body)
    except httpx.HTTPError as e:
        return type(e).__name__, time.perf_counter() - start, 0
    latency = time.perf_counter() - start
    if r.status_code != 200:
        return f"{r.status_code} {r.json().get('error', {}).get('code')}", latency, 0
    return None, latency, r.json().get("usage", {}).get("completion_tokens", 0)


async def run_heavy(base_url, api_key, heavy, short, args):
    """args.heavy clients loop the heavy body from 127.0.0.1 while one client from args.short_address sends the
    short chat request, after a second of load, then after each answer and a pause of 0.2 s; no new request after
    args.level_seconds. ([heavy results], [short results], seconds), each result as timed_post gives it."""
    headers, started = {"Authorization": f"Bearer {api_key}"}, time.perf_counter()
    heavy_results, short_results = [], []
    limits = httpx.Limits(max_connections=args.heavy, max_keepalive_connections=args.heavy)
    short_transport = httpx.AsyncHTTPTransport(local_address=args.short_address)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=args.request_timeout) as heavy_client, \
            httpx.AsyncClient(base_url=base_url, headers=headers, transport=short_transport,
                              timeout=args.request_timeout) as short_client:
        running = lambda: time.perf_counter() - started < args.level_seconds  # noqa: E731

        async def heavy_loop():
            while running():
                heavy_results.append(await timed_post(heavy_client, "/v1/completions", heavy))

        async def short_loop():
            await asyncio.sleep(1.0)  # the heavy clients' first requests are running
            while running():
                short_results.append(await timed_post(short_client, "/v1/chat/completions", short))
                await asyncio.sleep(0.2)

        await asyncio.gather(*(heavy_loop() for _ in range(args.heavy)), short_loop())
    return heavy_results, short_results, time.perf_counter() - started


def summarize_heavy(clients, heavy_results, short_results, seconds):
    """The table row of a --heavy run, and its error kinds that are defects (any but a full server's 503)."""
    results = heavy_results + short_results
    short_ok = [latency for error, latency, _ in short_results if error is None]
    errors = Counter(error for error, _, _ in results if error is not None)
    row = (f"| {clients} | {sum(error is None for error, _, _ in heavy_results)} | {len(short_results)} | "
           f"{len(short_ok)} | {percentile_ms(short_ok, 50)} | {percentile_ms(short_ok, 99)} | "
           f"{percentile_ms(short_ok, 100)} | {sum(tokens for _, _, tokens in results) / seconds:.1f} | "
           f"{seconds:.1f} | {', '.join(f'{kind}: {n}' for kind, n in sorted(errors.items())) or 'none'} |")
    return row, {kind: n for kind, n in errors.items() if kind != EXPECTED}


def heavy_run(base_url, api_key, health, args):
    """Print a --heavy run's bodies and table row; returns its defects. The heavy body is clipped to what the
    server allows (its max_tokens_limit and n_sup_max)."""
    heavy = {**HEAVY, "max_tokens": min(HEAVY["max_tokens"], health["max_tokens_limit"]),
             "n_sup": min(HEAVY["n_sup"], health["n_sup_max"])}
    print(f"model {health['model_tag']} step {health['step']}; server --max_concurrency {health['max_concurrency']}; "
          f"{args.heavy} heavy clients from 127.0.0.1 loop {json.dumps(heavy)}; one client from "
          f"{args.short_address} sends {json.dumps(SHORT)} (n_sup {health['n_sup_inference']}, the model's) after "
          f"each answer and 0.2 s; {args.level_seconds:.0f} s; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    heavy_results, short_results, seconds = asyncio.run(run_heavy(base_url, api_key, heavy, SHORT, args))
    row, defects = summarize_heavy(args.heavy, heavy_results, short_results, seconds)
    print("| heavy clients | heavy ok | short requests | short ok | short p50 ms | short p99 ms | short max ms | "
          "tokens/s | seconds | errors |")
    print("|---" * 10 + "|")
    print(row, flush=True)
    return defects


def percentile_ms(values, q, decimals=0):
    return f"{np.percentile(values, q) * 1000:.{decimals}f}" if values else "-"


def summarize(concurrency, results, seconds, rss=None, depth=None, connections=None):
    """One table row of a level, and its error kinds that are defects (not the expected 503); rss: the server's MiB
    after the level; depth: (n_sup, mean steps per token, answer bpb) for the depth columns; connections: reused or
    new, for its column."""
    ok = [r for r in results if r[0] is None]
    latencies = [r[1] for r in ok]
    ttfts = [r[2] for r in ok if r[3] and r[2] is not None]
    tpots = [(r[1] - r[2]) / (r[4] - 1) for r in ok if r[3] and r[2] is not None and r[4] > 1]
    errors = Counter(r[0] for r in results if r[0] is not None)
    columns = ""
    if depth is not None:
        n_sup, steps, bpb = depth
        columns = (f"{'all' if n_sup is None else n_sup} | {'-' if steps is None else f'{steps:.2f}'} | "
                   f"{'-' if bpb is None else f'{bpb:.4f}'} | ")
    columns = ("" if connections is None else f"{connections} | ") + columns
    row = (f"| {concurrency} | {columns}{len(results)} | {len(ok)} | {len(ok) / seconds:.2f} | "
           f"{sum(r[4] for r in ok) / seconds:.1f} | {percentile_ms(latencies, 50)} | {percentile_ms(latencies, 99)} | "
           f"{percentile_ms(ttfts, 50)} | {percentile_ms(ttfts, 99)} | {percentile_ms(tpots, 50, 1)} | "
           f"{'-' if rss is None else f'{rss:.0f}'} | "
           f"{', '.join(f'{kind}: {n}' for kind, n in sorted(errors.items())) or 'none'} |")
    return row, {kind: n for kind, n in errors.items() if kind != EXPECTED}


def steps_counter(base_url, api_key):
    """(sum, count) of the server's steps-per-token histogram (/metrics): the difference over a level is its mean."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {api_key}"}).text
    value = lambda name: next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")),
                              0.0)
    return value("nanochat_steps_per_token_sum"), value("nanochat_steps_per_token_count")


def held_out_windows(count, length, seed):
    """count windows of length tokens from the validation split under $NANOCHAT_BASE_DIR (its tokenizer's ids; each
    document cut into windows that do not overlap, count of them drawn at random), and the tokenizer."""
    from nanochat.data.dataset import iter_documents
    from nanochat.data.tokenizer import get_tokenizer
    tokenizer = get_tokenizer()
    windows = []
    for document in iter_documents("val"):
        ids = tokenizer.encode(document, prepend=tokenizer.get_bos_token_id())
        windows += [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
        if len(windows) >= 4 * count:  # enough to choose from; a big split is not read whole
            break
    if len(windows) < count:
        raise SystemExit(f"error: the validation split holds {len(windows)} windows of {length} tokens, not "
                         f"--score {count}; lower --score")
    return random.Random(seed).sample(windows, count), tokenizer


def answer_bpb(base_url, api_key, windows, answer_tokens, tokenizer, n_sup=None):
    """Bits per byte of each window's last answer_tokens tokens given the rest, through the server (echo and
    logprobs, nothing generated) at depth n_sup: what the model's answers cost under that depth or halting rule."""
    nats, n_bytes = 0.0, 0
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=120) as client:
        for ids in windows:
            body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0,
                    **({} if n_sup is None else {"n_sup": n_sup})}
            r = client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise SystemExit(f"error: scoring a window got {r.status_code}: {r.text[:200]}")
            logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            nats -= sum(logprobs[-answer_tokens:])
            n_bytes += len(tokenizer.decode(ids[-answer_tokens:]).encode("utf-8"))
    return nats / math.log(2) / n_bytes


def trained_tiny_checkpoint(base_dir):
    """Train the tests' tiny checkpoint (tag 'tiny') under base_dir; returns its tag."""
    sys.path.insert(0, REPO)
    os.environ["NANOCHAT_BASE_DIR"] = base_dir
    from tests.support.tiny_checkpoint import MODEL_TAG, build_tiny_checkpoint
    build_tiny_checkpoint()
    return MODEL_TAG


def levels_run(proc, base_url, api_key, health, model_tag, args):
    """Print the levels' table (every level at every depth and kind of connection); returns its defects."""
    context = health["sequence_len"]
    args.max_tokens = min(args.max_tokens, health["max_tokens_limit"])
    rng = random.Random(args.seed)
    lengths = sorted({max(1, context // 10), max(1, context // 2), max(1, context * 9 // 10)})
    if args.score:
        windows, tokenizer = held_out_windows(args.score, context, args.seed)
        prompts = [windows[i][:n] for i, n in enumerate(lengths)]  # held-out text the answers continue
    else:
        prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]  # byte tokens: in every vocabulary
    print(f"model {model_tag} step {health['step']} (context {context}); server --max_concurrency "
          f"{health['max_concurrency']} --queue_timeout {args.queue_timeout or 'default'}; {args.requests} "
          f"requests per level "
          f"(at most {args.level_seconds:.0f} s), max_tokens {args.max_tokens}, prompts of {lengths} tokens "
          f"({'held-out text' if args.score else 'random'}), half streamed; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    bpb = {}
    for n_sup in args.depths if args.score else ():
        bpb[n_sup] = answer_bpb(base_url, api_key, windows, args.max_tokens, tokenizer, n_sup)
    rss_before = rss_mib(proc.pid)
    compare = args.depths != [None] or args.score
    depth = "n_sup | steps/token | answer bpb | " if compare else ""
    print(f"| clients | connections | {depth}requests | ok | ok req/s | tokens/s | p50 ms | p99 ms | "
          f"TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | RSS MiB | errors |")
    print("|---" * (13 + 3 * bool(compare)) + "|")
    defects = Counter()
    for concurrency in args.levels:
        # interleaved, so that the machine's load falls on every depth and kind of connection alike
        for n_sup, kind in itertools.product(args.depths, args.kinds):
            before = steps_counter(base_url, api_key)
            results, seconds = asyncio.run(run_level(base_url, api_key, concurrency, prompts, args, n_sup, kind))
            after = steps_counter(base_url, api_key)
            steps = (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else None
            depth = (n_sup, steps, bpb.get(n_sup)) if compare else None
            row, level_defects = summarize(concurrency, results, seconds, rss_mib(proc.pid), depth, kind)
            print(row, flush=True)
            defects.update(level_defects)
    fmt = lambda mib: "n/a" if mib is None else f"{mib:.0f} MiB"  # noqa: E731
    print(f"server RSS: {fmt(rss_before)} before the first level, {fmt(rss_mib(proc.pid))} after the last")
    return defects


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as scratch:
        if args.model_tag is None:
            base_dir, model_tag = scratch, trained_tiny_checkpoint(scratch)
        else:
            base_dir, model_tag = get_base_dir(), args.model_tag
        api_key = secrets.token_urlsafe(24)
        with server(base_dir, model_tag, api_key, args) as (proc, base_url):
            health = httpx.get(f"{base_url}/health", headers={"Authorization": f"Bearer {api_key}"}).json()
            if args.heavy:
                defects = Counter(heavy_run(base_url, api_key, health, args))
            else:
                defects = levels_run(proc, base_url, api_key, health, model_tag, args)
            alive = proc.poll() is None
    if not alive:
        defects["server exited"] += 1
    if defects:
        print(f"DEFECTS (errors other than {EXPECTED}): {dict(defects)}", file=sys.stderr)
        return ExitCode.FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
