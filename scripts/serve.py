"""
Serve a checkpoint over OpenAI's completions and chat APIs (FastAPI + uvicorn), on localhost by default, with the
refinement viewer at /. The routes, their answers and errors: nanochat/serve/server.py and docs/serving.md.

.venv/bin/python -m pip install -e '.[serve]'
python -m scripts.serve --model_tag d12 --step best --port 8000 --max_concurrency 20
NANOCHAT_API_KEY=<secret> python -m scripts.serve --host 0.0.0.0 ...   # other machines: with a key

With a key (--api_key or NANOCHAT_API_KEY) every route but /health needs the header Authorization: Bearer <key>, as
at OpenAI and vLLM; without one, listening beyond loopback (--host 0.0.0.0) is refused unless --allow_no_auth. Key
or not, other sites' pages can neither use nor read it: bodies are JSON only, a Host that does not name the server
and an Origin other than its own are refused (--allowed_hosts, --allowed_origins widen this). A client that sends too
slowly gets a 408 (--header_timeout, --read_timeout); one that leaves its answer unread is dropped (--write_timeout).
One client (an address) holds at most a share of the connections and of the generation slots, and slots go to the
client running fewest (--max_connections_per_client, --max_concurrency_per_client; docs/serving.md#under-load).
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split
import argparse
import math
import os
import sys

from nanochat.cli import missing_package

try:
    import uvicorn

    from nanochat.serve import http, refinement
    from nanochat.serve.server import Server, create_app
except ModuleNotFoundError as e:
    sys.exit(f"error: {missing_package(e, 'the server')}")

from nanochat import checkpoint as ckpt
from nanochat.cli import ArgumentParser, ExitCode
from nanochat.common import autocast_for, autodetect_device_type, compute_init, default_dtype, device_available
from nanochat.model.engine import Engine


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
    parser = ArgumentParser(description="Serve a checkpoint over OpenAI's completions and chat completions APIs",
                            formatter_class=DefaultsHelp)
    ckpt.checkpoint_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=number_arg(int), default=8000, help="port to listen on; 0 = any free port")
    parser.add_argument("--max_concurrency", type=number_arg(int), default=20,
                        help="requests generating at once, batched together (each forward serves them all); more "
                             "wait up to --queue_timeout")
    parser.add_argument("--max_concurrency_per_client", type=number_arg(int), default=None,
                        help="requests one client address may have generating at once; its others wait, and a freed "
                             "slot goes to the waiting client running fewest (default: --max_concurrency less a fifth "
                             "of it, at least 1: 16 of the default 20, so one client runs as many as before issue 56 "
                             "and 4 stay for others)")
    parser.add_argument("--queue_timeout", type=number_arg(float), default=30.0,
                        help="seconds a request waits for a busy slot (0: answer 503 at once when all are busy)")
    parser.add_argument("--max_tokens_limit", type=number_arg(int), default=None,
                        help="largest max_tokens (default: context)")
    parser.add_argument("--max_batch", type=number_arg(int), default=8,
                        help="most completions per request (prompts x n)")
    parser.add_argument("--read_timeout", type=number_arg(float), default=http.READ_TIMEOUT_S,
                        help="seconds a request's headers and body may take to arrive; then 408 and the connection "
                             "closes (a slow client no longer holds one forever)")
    parser.add_argument("--header_timeout", type=number_arg(float), default=None,
                        help=f"seconds a request's headers may take to arrive, at most --read_timeout; then 408 (a "
                             f"client trickling them holds a connection that long; default: {http.HEADER_TIMEOUT_S:g}, "
                             f"or --read_timeout if less)")
    parser.add_argument("--write_timeout", type=number_arg(float), default=http.WRITE_TIMEOUT_S,
                        help="seconds a client may leave its answers unread once its receive window is full (the "
                             "server's bytes for it stop going down); then the connection is dropped (a client that "
                             "never reads no longer holds one forever)")
    parser.add_argument("--max_connections", type=number_arg(int), default=http.MAX_CONNECTIONS,
                        help="open connections at most; one more is answered 503 and closed")
    parser.add_argument("--max_connections_per_client", type=number_arg(int), default=None,
                        help="open connections from one client address (IPv6: one /64) at most; one more is "
                             "answered 503 and closed (default: a quarter of --max_connections, at least 1; behind a "
                             "reverse proxy every client is the proxy's address: set it to --max_connections)")
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
    for name in ("read_timeout", "write_timeout", "header_timeout"):
        if getattr(args, name) is not None and not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            parser.error(f"--{name}={getattr(args, name)}: must be a number of seconds > 0")
    if args.header_timeout is None:
        args.header_timeout = min(http.HEADER_TIMEOUT_S, args.read_timeout)
    elif args.header_timeout > args.read_timeout:
        parser.error(f"--header_timeout={args.header_timeout:g}: must be at most --read_timeout={args.read_timeout:g} "
                     f"(the whole request's deadline)")
    for name in ("max_concurrency", "max_batch", "max_tokens_limit", "max_connections", "max_concurrency_per_client",
                 "max_connections_per_client"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name}={value}: must be >= 1")
    if args.max_concurrency_per_client is None:
        args.max_concurrency_per_client = max(1, args.max_concurrency - max(1, args.max_concurrency // 5))
    if args.max_connections_per_client is None:
        args.max_connections_per_client = max(1, int(args.max_connections * http.CLIENT_SHARE))
    for name, total in (("max_concurrency_per_client", "max_concurrency"),
                        ("max_connections_per_client", "max_connections")):
        if getattr(args, name) > getattr(args, total):
            parser.error(f"--{name}={getattr(args, name)}: must be at most --{total}={getattr(args, total)}")
    args.device_type = args.device_type or autodetect_device_type()
    if not device_available(args.device_type):
        parser.error(f"--device_type={args.device_type} is not available on this machine")
    return args


def build_server(args):
    """(uvicorn.Server, Server) for parsed args; the caller runs it on a socket it bound."""
    device = compute_init(args.device_type)[4]  # TF32 matmuls on CUDA, as in training
    model, tokenizer, meta, model_tag, _ = ckpt.open_checkpoint(args.model_tag, args.step, device)
    info = {"model_tag": model_tag, "step": meta["step"]}
    dtype = default_dtype(args.device_type)  # bf16 matmuls and KV cache on GPU
    engine = Engine(model, tokenizer, autocast=lambda: autocast_for(args.device_type, dtype))
    server = Server(engine, info, args.max_concurrency, args.max_tokens_limit, args.queue_timeout,
                    args.max_batch, refinement.trained_hops_corpus(meta), args.max_concurrency_per_client)
    app = create_app(server, args.api_key, args.host, args.allowed_hosts, args.allowed_origins)
    protocol = http.guarded_http(args.read_timeout, args.max_connections, args.write_timeout, server.metrics.refused,
                                 args.header_timeout, args.max_connections_per_client)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off",
                            http=protocol)
    return uvicorn.Server(config), server


def auth_problem(args):
    """Why the server must not start with these flags (None when it may): reachable from other machines, no key."""
    if args.api_key or args.allow_no_auth or http.is_loopback(args.host):
        return None
    return (f"--host={args.host} can be reached from other machines and no API key is set: set NANOCHAT_API_KEY (or "
            f"--api_key) to require one, or pass --allow_no_auth to serve anyone who can connect")


def main(argv=None):
    args = parse_args(argv)
    problem = auth_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        sock = http.listen(args.host, args.port)  # before the model loads: a taken port fails in a second, not a minute
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else e
        print(f"error: cannot listen on {args.host}:{args.port}: {reason}; pick another --port (0 = any free port)",
              file=sys.stderr)
        return ExitCode.USAGE
    with sock:
        try:
            web, server = build_server(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return ExitCode.USAGE
        host, port = sock.getsockname()[:2]
        base = f"http://{f'[{host}]' if ':' in host else host}:{port}"  # an IPv6 address goes in brackets in a URL
        print(f"serving {server.model_id} step {server.info['step']} at {base}/v1 (OpenAI's completions and chat "
              f"completions APIs: POST /v1/completions, /v1/chat/completions; max_concurrency={args.max_concurrency}; "
              f"{'API key required' if args.api_key else 'no API key'}); the refinement viewer: {base}/", flush=True)
        try:
            web.run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down cleanly, then may re-raise the signal
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
