"""The connection and the request, before any route: uvicorn's protocol with header, read and write deadlines, caps
on connections in all and per client, and no Nagle delay (GuardedHTTP); who a client is (client_key); the Host,
Origin and security headers of every answer (Gate); the API key (key_checker, key_holder); where to listen."""

import base64
import hashlib
import hmac
import ipaddress
import json
import re
import socket
import struct
import urllib.parse
from collections import Counter

try:  # for unread_bytes: Linux's SIOCOUTQ
    import fcntl
    import termios
except ImportError:
    fcntl = termios = None

import h11
from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.routing import Match
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanochat.serve.api import APIError, error_response

READ_TIMEOUT_S, MAX_CONNECTIONS = 30.0, 256  # the flags' defaults: nginx reads headers and body in 60 s each
# --header_timeout's default: headers are one packet or two, which a client sends in well under a second even over a
# slow link with two lost packets (1 s, then 2 s to retransmit); one that trickles them holds a connection 5 s, not 30
HEADER_TIMEOUT_S = 5.0
# --max_connections_per_client's default, as a share of --max_connections: one address holding its share leaves
# three quarters to everyone else, and 64 at the default cap is more than browsers (6 per host) or eval harnesses open
CLIENT_SHARE = 1 / 4

WRITE_TIMEOUT_S = 30.0  # --write_timeout's default: as nginx's send_timeout, from the client's last read


def client_key(host):
    """Whom a connection or request counts against: its IPv4 address, or its IPv6 address's /64 (a host is given a
    /64 to pick addresses from, so one address each would be no limit); a host that is no address counts as itself."""
    try:
        address = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return str(host)
    if address.version == 6 and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.ip_network(f"{address}/64", strict=False)) if address.version == 6 else str(address)


def request_client(request):
    """The client_key of an ASGI request's peer (None: no request, as in-process callers start generations)."""
    peer = getattr(request, "client", None)
    return client_key(peer.host if peer else None)


class GuardedHTTP(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with deadlines for a request's headers and for all of it, a write deadline, caps
    on open connections in all and per client, and no Nagle delay: uvicorn has none of them (its keep-alive timeout
    starts after a response, --limit-concurrency answers only once a request's headers arrive, and a client that
    stops reading is waited for forever), so a client sending slowly, or never reading, held a connection forever,
    and one address could hold them all. Subclassed by guarded_http."""
    read_timeout, header_timeout, write_timeout = READ_TIMEOUT_S, HEADER_TIMEOUT_S, WRITE_TIMEOUT_S
    max_connections, max_connections_per_client = MAX_CONNECTIONS, int(MAX_CONNECTIONS * CLIENT_SHARE)
    # the connections let in and open, by client_key (one refused is no share of the caps, however many arrive);
    # guarded_http gives each server a Counter of its own
    per_client = Counter()
    # told the status and reason of every answer given here, not by the app
    refused = staticmethod(lambda status, reason: None)

    def connection_made(self, transport):
        super().connection_made(transport)
        self.deadline = self.write_deadline = self.unread_watch = self.phase = None
        self.dropped = False
        self.key, self.admitted = client_key(self.client[0] if self.client else None), False
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets it only on sockets made with proto IPPROTO_TCP, and socket.create_server's are proto 0:
            # without it a response's second write waits ~40 ms for the client's delayed ACK (Nagle's algorithm)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # pause as soon as anything waits in user space (the kernel's buffers are full: the client is not reading),
        # so that the write deadline runs from then, and a response cannot complete with bytes still queued here
        transport.set_write_buffer_limits(high=0)
        if self.per_client.total() >= self.max_connections:
            self.refuse(503, "Service Unavailable", f"server busy: {self.max_connections} connections open "
                                                    f"(--max_connections); retry later", "max_connections")
        elif self.per_client[self.key] >= self.max_connections_per_client:
            self.refuse(503, "Service Unavailable", f"server busy: your address has {self.max_connections_per_client} "
                                                    f"connections open, the most one client may "
                                                    f"(--max_connections_per_client); close one or retry later",
                        "max_connections_per_client")
        else:
            self.admitted = True
            self.per_client[self.key] += 1
            self.watch()

    def data_received(self, data):
        super().data_received(data)
        self.watch()

    def watch(self):
        """Arm the deadline that applies now: header_timeout from a request's first byte (or the connection's start)
        until its headers are parsed, then read_timeout from the same start until it is all here; none after."""
        state = self.conn.their_state
        if state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):  # the request is all here
            self.disarm()
            return
        if self.deadline is None:  # a request (a keep-alive connection's next one, too) began
            self.began = self.loop.time()
        phase = "header" if state is h11.IDLE else "read"  # h11 leaves IDLE once the headers are parsed
        if phase != self.phase:
            self.disarm()
            limit = self.header_timeout if phase == "header" else self.read_timeout
            self.phase = phase
            self.deadline = self.loop.call_later(max(0.0, self.began + limit - self.loop.time()), self.timed_out)

    def connection_lost(self, exc):
        if self.admitted:
            self.per_client[self.key] -= 1
            if not self.per_client[self.key]:  # the Counter holds the clients connected now, not all ever seen
                del self.per_client[self.key]
        self.disarm()
        self.stop_write_deadline()
        if self.unread_watch is not None:
            self.unread_watch.cancel()
        super().connection_lost(exc)

    def on_response_complete(self):
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0] and not self.transport.is_closing():
            self.watch()  # part of a pipelined next request was waiting: its deadlines run
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
            self.refused(0, "write_timeout")  # no status: nothing more can reach the client
        self.transport.abort()  # close() would wait for the unread bytes to be sent: forever

    def send_400_response(self, msg):  # a request h11 cannot parse
        self.refused(400, "bad_request")
        super().send_400_response(msg)

    def disarm(self):
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = self.phase = None

    def timed_out(self):
        phase, self.deadline, self.phase = self.phase, None, None
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no answer to this request has begun
            if phase == "header":
                self.refuse(408, "Request Timeout", f"the request's headers did not arrive within "
                                                    f"{self.header_timeout:g} s (--header_timeout)", "header_timeout")
            else:
                self.refuse(408, "Request Timeout", f"the request did not arrive within {self.read_timeout:g} s "
                                                    f"(--read_timeout)", "read_timeout")
        elif not self.transport.is_closing():  # answered already (a 400 before its body ended), or answering
            self.transport.close()

    def refuse(self, status, reason, message, why):
        """Answer status and close; why: the reason /metrics counts it under."""
        self.refused(status, why)
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
                 refused=None, header_timeout=None, max_connections_per_client=None):
    """The protocol class uvicorn.Config(http=...) takes, with these limits (header_timeout: HEADER_TIMEOUT_S or
    read_timeout, the lesser; max_connections_per_client: CLIENT_SHARE of max_connections, at least 1);
    refused(status, reason) counts the answers the protocol gives itself (408, 503, an unparsable request's 400; 0 for
    a client dropped by the write deadline), reason naming the limit."""
    header_timeout = min(HEADER_TIMEOUT_S, read_timeout) if header_timeout is None else header_timeout
    if max_connections_per_client is None:
        max_connections_per_client = max(1, int(max_connections * CLIENT_SHARE))
    limits = {"read_timeout": read_timeout, "max_connections": max_connections, "write_timeout": write_timeout,
              "header_timeout": header_timeout, "max_connections_per_client": max_connections_per_client,
              "per_client": Counter()}
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

        headers = {}  # every value of each header: a dict of one value each would let the last of several win
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1").lower(), []).append(v.decode("latin-1"))
        refusal = self.refusal(headers)
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
        """An error response for a request that must not be served here, or None. headers: name -> every value."""
        hosts = headers.get("host", [])
        if len(hosts) > 1:  # RFC 9112 3.2: a 400; which one a proxy or the app would read is anyone's guess
            return error_response(400, f"the request has {len(hosts)} Host headers; send one", code="invalid_host")
        host = hosts[0] if hosts else None
        name = host_name(host)[0] if host is not None else None
        if host is not None and not (name is not None and self.hosts.allows(name)):
            return error_response(400, f"the Host header {json.dumps(host)} does not name this server "
                                       f"(--host={self.hosts.bound}); send the address it listens on, or start it "
                                       f"with --allowed_hosts={name or 'NAME'} to serve that name too",
                                  code="invalid_host")
        for origin in headers.get("origin", []):  # a browser sends one; any foreign one among several is refused
            if not same_origin(origin, host or "", self.origins):
                return error_response(403, f"a web page of another origin ({origin}) may not use this server: a "
                                           f"page elsewhere must not make it generate or read its answers; start it "
                                           f"with --allowed_origins={origin} to allow that page",
                                      code="forbidden_origin")
        return None


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


def key_holder(api_key):
    """A FastAPI dependency: whether the request holds the key (always, when the server has none); no Authorization
    header is False, a wrong key key_checker's 401 (a client sending one is misconfigured: say so)."""
    bearer, check = HTTPBearer(auto_error=False), key_checker(api_key) if api_key else None

    async def holds(credentials: HTTPAuthorizationCredentials | None = Security(bearer)):
        if check is None:
            return True
        if credentials is None:
            return False
        await check(credentials)
        return True

    return holds


def is_loopback(host):
    """Whether every address host names is a loopback one, so that only this machine can connect."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):  # not resolvable: the listen fails later, saying so
        return False
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def listen(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)
