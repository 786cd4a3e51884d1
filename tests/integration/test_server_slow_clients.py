"""Issue 45, finding 7 (the HTTP side): slow clients. 1,050 slowloris connections, each sending a
header byte now and then, stayed open for 70 s and held 1,023 descriptors. Against a real `kvpipe
serve` (its real listener: kvpipe/http_listener.py) with short deadlines: bounded slowloris runs
of one header byte per second per socket, and a body trickled a byte a second. A genuine request
is served during the attack, below the cap and past it (a new connection past the cap takes the
place of the slowest one); every slow connection is cut after its deadline or its eviction (408
for a head), and the server's open descriptors return to where they started. The 503 past a cap
of connections that all have a request in: tests/integration/test_listener_cap.py.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.http_wire import read_response
from tests.helpers.server import ServerProc, server_fixture

pytestmark = pytest.mark.timeout(300)

HEAD_TIMEOUT_S, BODY_TIMEOUT_S, CAP = 6, 3, 200
HEAD = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 64
GENUINE = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    flags = ("--http-header-timeout", str(HEAD_TIMEOUT_S), "--http-body-timeout", str(BODY_TIMEOUT_S))
    yield from server_fixture(tiny_model_dir, tmp_path_factory.mktemp("slow"), *flags, "--max-connections", str(CAP))


def _open_fds(srv: ServerProc) -> int:
    return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))


def _settled_fds(srv: ServerProc, at_most: int, timeout_s: float = 30.0) -> int:
    deadline, n = time.monotonic() + timeout_s, _open_fds(srv)
    while n > at_most and time.monotonic() < deadline:
        time.sleep(0.2)
        n = _open_fds(srv)
    return n


class Slowloris:
    """`n` connections to the server, each sending the next byte of a request every second."""

    def __init__(self, srv: ServerProc, n: int, payload: bytes = HEAD) -> None:
        port = int(srv.url.rsplit(":", 1)[1])
        self.payload, self.sent = payload, 0
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]
        for s in self.socks:
            s.setblocking(False)
        self.answers: dict[int, bytes] = {}  # socket index -> what the server sent before closing
        self.answered_at: dict[int, float] = {}  # socket index -> when its answer's first bytes were read
        self.closed_at: dict[int, float] = {}

    def tick(self) -> None:
        """Read what the server sent (its answer, or its close), then send one more byte on every
        connection still open."""
        at = self.sent % len(self.payload)
        byte, now = self.payload[at : at + 1], time.monotonic()
        self.sent += 1
        for i, s in enumerate(self.socks):
            if i in self.closed_at:
                continue
            try:
                data = s.recv(4096)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data:  # its answer; the close comes with the next read
                self.answers[i] = self.answers.get(i, b"") + data
                self.answered_at.setdefault(i, now)
            elif data == b"":
                self.closed_at[i] = now
            else:
                try:
                    s.send(byte)
                except OSError:
                    self.closed_at[i] = now

    def run_until_cut(self, limit_s: float) -> None:
        end = time.monotonic() + limit_s
        while len(self.closed_at) < len(self.socks) and time.monotonic() < end:
            self.tick()
            time.sleep(1.0)

    def close(self) -> None:
        for s in self.socks:
            s.close()

    def statuses(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for data in self.answers.values():
            status = data.split(b"\r\n", 1)[0].decode(errors="replace")
            out[status] = out.get(status, 0) + 1
        return out


def test_slowloris_under_the_cap(server: ServerProc) -> None:
    """150 slow heads: a genuine request is served meanwhile; every slow one gets 408 after the head
    deadline and is closed; the descriptors come back."""
    assert server.post("/generate", json=GENUINE).status_code == 200
    baseline = _settled_fds(server, at_most=10**6)
    start = time.monotonic()
    attack = Slowloris(server, 150)
    try:
        attack.tick()
        deadline = time.monotonic() + HEAD_TIMEOUT_S - 0.5
        while _open_fds(server) < baseline + 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _open_fds(server) >= baseline + 100  # the server holds them now
        with httpx.Client(timeout=30) as c:
            r = c.post(server.url + "/generate", json=GENUINE)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
        attack.run_until_cut(HEAD_TIMEOUT_S + 15)
    finally:
        attack.close()
    assert len(attack.closed_at) == 150, f"{150 - len(attack.closed_at)} slow connections were never cut"
    assert attack.statuses() == {"HTTP/1.1 408 Request Timeout": 150}
    assert min(attack.closed_at.values()) - start >= HEAD_TIMEOUT_S - 0.5  # cut by the deadline, not before
    assert _settled_fds(server, at_most=baseline + 2) <= baseline + 2
    assert server.get("/health").status_code == 200


def test_slowloris_past_the_cap(server: ServerProc) -> None:
    """300 slow heads against a cap of 200: each one past the cap takes the place of the one that
    has waited longest (408, closed at once, long before the head deadline), so the server never
    holds more than the cap, and a genuine request during the attack is served (it, too, takes a
    slow one's place, then sends its request at once); the rest are cut by the deadline."""
    baseline = _settled_fds(server, at_most=10**6)
    start = time.monotonic()
    attack = Slowloris(server, 300)
    try:
        attack.tick()
        time.sleep(1.0)
        attack.tick()  # reads the evicted ones' answers
        assert attack.statuses() == {"HTTP/1.1 408 Request Timeout": 300 - CAP}, attack.statuses()
        assert _open_fds(server) <= baseline + CAP + 2  # never more descriptors than the cap's
        with httpx.Client(timeout=30) as c:
            r = c.post(server.url + "/generate", json=GENUINE)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text
        attack.run_until_cut(HEAD_TIMEOUT_S + 15)
    finally:
        attack.close()
    assert len(attack.closed_at) == 300
    assert attack.statuses() == {"HTTP/1.1 408 Request Timeout": 300}  # no 503: every one was evictable
    # the evicted (the 100 past the cap, and the one the genuine request replaced) were answered as
    # newer ones came, before any deadline; the held ones by the deadline
    at = sorted(t - start for t in attack.answered_at.values())
    assert at[300 - CAP] < HEAD_TIMEOUT_S - 0.5 <= at[300 - CAP + 1], at[300 - CAP - 1 : 300 - CAP + 3]
    assert _settled_fds(server, at_most=baseline + 2) <= baseline + 2
    assert server.post("/generate", json=GENUINE).status_code == 200


def test_a_trickled_body_is_cut(server: ServerProc) -> None:
    """A whole head, then a body of a byte a second: closed after the body deadline (its bytes
    bought it 1/64 KiB of a second each); the app saw the client leave and logged no error."""
    baseline = _settled_fds(server, at_most=10**6)
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    attack = Slowloris(server, 20, payload=b"{" + b" " * 999)
    try:
        for s in attack.socks:
            s.sendall(head)
        start = time.monotonic()
        attack.run_until_cut(BODY_TIMEOUT_S + 15)
    finally:
        attack.close()
    assert len(attack.closed_at) == 20
    assert min(attack.closed_at.values()) - start >= BODY_TIMEOUT_S - 0.5
    assert _settled_fds(server, at_most=baseline + 2) <= baseline + 2
    assert "Traceback" not in server.log() and "unhandled error" not in server.log()
    assert server.post("/generate", json=GENUINE).status_code == 200


def test_a_kept_alive_connection_s_next_head_has_the_same_deadline(server: ServerProc) -> None:
    """After a served request, the next head trickled on the same connection is cut like a first
    one (uvicorn's keep-alive timer stops at its first byte; the head deadline starts there)."""
    port = int(server.url.rsplit(":", 1)[1])
    body = b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'
    request = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        first = read_response(s)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        start = time.monotonic()
        answer = b""
        for i in range(HEAD_TIMEOUT_S + 15):  # a byte a second of the next head
            try:
                s.sendall(HEAD[i : i + 1])
            except OSError:
                break
            s.settimeout(1.0)
            try:
                data = s.recv(4096)
            except TimeoutError:
                continue
            except ConnectionResetError:  # a byte sent after the cut was answered with RST
                break
            answer += data
            # stop at the answer: a next byte would reach a closed socket and reset this one
            if not data or b"\r\n\r\n" in answer:
                break
        cut = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert cut >= HEAD_TIMEOUT_S - 0.5, cut  # by the head deadline, not the keep-alive one
