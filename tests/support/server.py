"""An ASGI app served by uvicorn on a free port of 127.0.0.1 in a thread, for tests that need a real HTTP server
(a browser, a client that leaves mid-stream)."""

import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def serving(app, start_timeout_s=10):
    """Yields the base URL; the server stops (joined with a timeout) when the block ends."""
    with running(uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")), start_timeout_s) as url:
        yield url


@contextlib.contextmanager
def running(http, start_timeout_s=10):
    """A configured uvicorn.Server (its own limits, timeouts) run in a thread on a free port; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not http.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        sock.close()
