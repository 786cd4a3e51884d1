"""The listener's connection cap (kvpipe/http_listener.py, issue 45 finding 7) on a real uvicorn
server in this process with a cap of 3, so each case is a handful of sockets: a new connection
past the cap takes the place of the one that has waited longest for its client (a slow head, or
an idle kept-alive connection), and only when every connection has a request in the application
is a new one answered 503 with Retry-After and closed. The slowloris runs against the real
servers: test_server_slow_clients.py (HTTP server), test_slow_clients.py (bootstrap server)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from kvpipe.config import ListenerLimits
from kvpipe.http_listener import listener_settings
from tests.helpers.http_wire import read_response

pytestmark = pytest.mark.timeout(120)

CAP = 3
SLOW_HEAD = b"GET /quick HTTP/1.1\r\nHost: x\r\nX-Slow: a"  # never finished


class HoldingApp:
    """/hold answers once `release` is set (its request is in the application meanwhile); any
    other path at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.holding = 0

    async def __call__(self, scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        assert scope["type"] == "http"
        if scope["path"] == "/hold":
            self.holding += 1
            end = time.monotonic() + 60
            while not self.release.is_set() and time.monotonic() < end:
                await asyncio.sleep(0.01)
            self.holding -= 1
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def served() -> Iterator[tuple[int, HoldingApp]]:
    app = HoldingApp()
    limits = ListenerLimits(header_timeout_s=60, body_timeout_s=60, keep_alive_s=60, max_connections=CAP)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", **listener_settings(limits))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started and time.monotonic() < end:
        time.sleep(0.01)
    assert server.started
    try:
        yield sock.getsockname()[1], app
    finally:
        app.release.set()
        server.should_exit = True
        thread.join(30)
        sock.close()


def _connect(port: int, first: bytes = SLOW_HEAD) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(first)
    time.sleep(0.05)  # accepted and stamped in this order
    return s


def _answer(s: socket.socket) -> bytes:
    """What the server sent until it closed the connection."""
    out = b""
    while chunk := s.recv(4096):
        out += chunk
    return out


def _open(s: socket.socket) -> bool:
    """Whether the server still holds `s` silently (it neither answered nor closed it)."""
    s.settimeout(0.2)
    try:
        s.recv(1, socket.MSG_PEEK)  # an answer, or b"" for a close
        return False
    except TimeoutError:
        return True
    finally:
        s.settimeout(10)


def test_a_new_connection_evicts_the_one_waiting_longest(served: tuple[int, HoldingApp]) -> None:
    port, _ = served
    kept = socket.create_connection(("127.0.0.1", port), timeout=10)  # a served, then idle, connection
    kept.sendall(b"GET /quick HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(kept).startswith(b"HTTP/1.1 200")
    time.sleep(0.05)
    slow = [_connect(port), _connect(port)]  # the cap is full: kept (idle since its answer), slow[0], slow[1]
    newest = _connect(port)  # takes the idle connection's place: it waited longest
    assert _answer(kept) == b""  # closed without a word, as uvicorn's keep-alive timeout would
    assert all(_open(s) for s in [*slow, newest])
    with httpx.Client(timeout=10) as c:  # a genuine client: takes slow[0]'s place, then is served
        assert c.get(f"http://127.0.0.1:{port}/quick").text == "ok"
    first = _answer(slow[0])
    assert first.startswith(b"HTTP/1.1 408 Request Timeout") and b"connection: close" in first
    assert _open(slow[1]) and _open(newest)
    for s in [kept, *slow, newest]:
        s.close()


def test_503_only_when_every_connection_has_a_request_in(served: tuple[int, HoldingApp]) -> None:
    port, app = served
    hold = b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n"
    held = [_connect(port, hold) for _ in range(CAP)]
    end = time.monotonic() + 30
    while app.holding < CAP and time.monotonic() < end:
        time.sleep(0.01)
    assert app.holding == CAP
    refused = _connect(port, b"GET /quick HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = _answer(refused)
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable") and b"retry-after: 1" in answer, answer
    assert app.holding == CAP  # nobody's request was cut for it
    app.release.set()
    for s in held:
        assert read_response(s).startswith(b"HTTP/1.1 200")
        s.close()
    refused.close()
    with httpx.Client(timeout=10) as c:
        assert c.get(f"http://127.0.0.1:{port}/quick").text == "ok"
