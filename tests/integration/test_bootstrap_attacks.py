"""Issue 45, findings 1, 2 and 6 (rank registrations), performed against a real decode's KVReceiver and a real prefill
(bootstrap server, ZMQ, local backend) in one process, on loopback.

1. The decode as an open proxy: a client's bootstrap_host with a path injected into it, a local
   service's error body in the client's error, loopback fetched whatever the allow list said,
   any address fetched without a token.
2. The decode as a signing oracle: a fake bootstrap server (127.0.0.2) that answers /health with
   the real prefill's instance id and relays the decode's signed look-up to the real prefill with
   the same Host header.
After each, both sides hold nothing (rooms, sessions) and the real transfer still works."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.control.auth import HTTP_HEADER, Authenticator
from kvpipe.transfer.control.bootstrap import (
    BootstrapError,
    BootstrapRefused,
    fetch_prefill_info,
    register_prefill_rank,
)
from kvpipe.transfer.lifecycle import TransferState
from tests.helpers.kv_transfer import CFG, SRC, Results, start_decode, start_prefill

TOKEN = "correct-horse-battery-staple"
SECRET = "internal-service-secret-body"
INJECTED = "::ffff:127.0.0.1]:{port}/internal/admin?delete=1#"  # the bootstrap_host


class _Recorder(BaseHTTPRequestHandler):
    """An HTTP service that records every request line and answers with `status` and a body."""

    seen: list[str]
    status = 404
    body = SECRET.encode()
    relay_to: str | None = None  # a real server to relay every call but /health to
    instance: str = ""
    relayed: list[tuple[int, bytes]]

    def _answer(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        length = int(self.headers.get("Content-Length") or 0)
        content = self.rfile.read(length) if length else b""
        status, body, headers = self.status, self.body, {"Content-Type": "application/json"}
        if self.relay_to is not None and self.path == "/health":
            status, body = 200, b'{"status": "ok", "instance": "%s"}' % self.instance.encode()
        elif self.relay_to is not None:  # the decode's signed call, with its own Host header
            keep = {k: v for k, v in self.headers.items() if k.lower() in ("host", HTTP_HEADER.lower(), "content-type")}
            r = httpx.request(
                self.command, self.relay_to + self.path, headers=keep, content=content, trust_env=False, timeout=60
            )
            status, body = r.status_code, r.content
            headers.update({k: v for k, v in r.headers.items() if k.lower().startswith("x-kvpipe")})
            self.relayed.append((status, body))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = _answer  # noqa: N815 - http.server's names

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def service(host: str = "127.0.0.1", **attrs: object) -> Iterator[tuple[ThreadingHTTPServer, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"seen": [], "relayed": [], **attrs})
    srv = ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv, handler
    finally:
        srv.shutdown()
        srv.server_close()


def test_finding1_an_injected_host_is_refused_before_any_connection(stack: ExitStack) -> None:
    recv = start_decode(stack)
    with service() as (srv, handler):
        port = srv.server_address[1]
        for host, p in (
            (INJECTED.format(port=port), port),
            (f"127.0.0.1:{port}/internal/admin?delete=1#", port),
            ("127.0.0.1", f"{port}/internal/admin"),
            ("127.0.0.1", True),
            ("127.0.0.1", float(port)),
            ("[127.0.0.1]", port),
        ):
            with pytest.raises(BootstrapRefused, match="bootstrap_(host|port)"):
                recv.add_room(1, host, p, np.arange(6))  # type: ignore[arg-type]
        assert handler.seen == []  # nothing connected anywhere
    assert recv.num_rooms() == 0 and recv.stats.bootstrap_fetches == 0


def test_finding1_a_local_service_body_never_reaches_the_error(stack: ExitStack) -> None:
    recv = start_decode(stack)  # no token: loopback only, and the same strict parsing
    rr = Results(recv)
    with service() as (srv, handler):
        recv.add_room(2, "127.0.0.1", srv.server_address[1], np.arange(6))
        _, state, reason, _ = rr.get(2)
        assert handler.seen == ["GET /v1/prefill/ranks"]  # the fixed path, never the client's
    assert state is TransferState.FAILED and "HTTP 404" in reason, reason
    assert SECRET not in reason and "internal" not in reason, reason
    assert recv.num_rooms() == 0


def test_finding1_no_token_loopback_only_and_allow_lists_cover_loopback(stack: ExitStack) -> None:
    plain = start_decode(stack)
    with pytest.raises(BootstrapRefused, match="loopback"):
        plain.add_room(3, "192.0.2.10", 8998, np.arange(6))  # TEST-NET-1: nothing is there
    listed = start_decode(stack, cfg=dataclasses.replace(CFG, auth_token=TOKEN, bootstrap_allow=("192.0.2.0/24",)))
    with service() as (srv, handler):
        for host in ("127.0.0.1", "::ffff:127.0.0.1", "localhost"):
            try:  # a literal is refused at once, a name by the fetch that resolves it
                listed.add_room(4, host, srv.server_address[1], np.arange(6))
            except BootstrapRefused as e:
                assert "bootstrap-allow" in str(e)
                continue
            _, state, reason, _ = Results(listed).get(4)
            assert state is TransferState.FAILED and "bootstrap-allow" in reason, reason
        assert handler.seen == []
    assert plain.num_rooms() == listed.num_rooms() == 0


def test_finding2_a_relayed_signed_lookup_is_refused_and_leaks_nothing(stack: ExitStack) -> None:
    cfg = dataclasses.replace(CFG, auth_token=TOKEN)
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, cfg=cfg)
    recv = start_decode(stack, fabric=fabric, cfg=cfg)
    real = f"http://127.0.0.1:{prefill.port}"
    instance = httpx.get(real + "/health", trust_env=False).json()["instance"]  # public
    with service("127.0.0.2", relay_to=real, instance=instance) as (fake, handler):
        recv.add_room(5, "127.0.0.2", fake.server_address[1], np.arange(6))
        _, state, reason, _ = Results(recv).get(5)
        assert handler.seen == ["GET /health", "GET /v1/prefill/ranks"]
        deadline = time.monotonic() + 60  # the relay's answer may land after the decode gave up
        while not handler.relayed and time.monotonic() < deadline:
            time.sleep(0.05)
        [(status, body)] = handler.relayed  # what the real prefill told the relay
    assert status == 401 and b"control_address" not in body and b"buffer_addrs" not in body
    assert state is TransferState.FAILED and "HTTP 401" in reason, reason
    assert prefill.server.auth_rejected == 1
    sender = prefill.senders[0]
    assert sender._book.peers.peers == {}  # the decode registered nowhere
    assert recv.num_rooms() == 0 and sender.num_rooms() == 0
    # the decode fetching from the real prefill itself is served
    recv.add_room(6, "127.0.0.1", prefill.port, np.arange(6))
    sender.add_room(6, SRC)
    sender.send(6, 0, 22, last=True, aux=(5, -0.5))
    assert Results(recv).get(6)[1] is TransferState.SUCCESS
    assert Results(sender).get(6)[1] is TransferState.SUCCESS
    assert recv.num_rooms() == sender.num_rooms() == 0


def test_finding6_a_token_holder_cannot_register_a_prefill_rank(stack: ExitStack) -> None:
    cfg = dataclasses.replace(CFG, auth_token=TOKEN)
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, cfg=cfg)
    sender = prefill.senders[0]
    insider = Authenticator.from_token(TOKEN)
    real = fetch_prefill_info("127.0.0.1", prefill.port, auth=insider)  # a token holder may look up
    mine = dataclasses.replace(real.ranks[0], control_address="tcp://127.0.0.1:1", data_address="127.0.0.1:2")
    for forged in (mine, dataclasses.replace(mine, instance_id="a-new-instance")):
        with pytest.raises(BootstrapError, match="HTTP 401"):
            register_prefill_rank("127.0.0.1", prefill.port, forged, auth=insider)
    # ... nor derive a prefill role key from the token: the registrar key is the instance's own
    for key in (hashlib.sha256(b"kvpipe-role-prefill\0" + TOKEN.encode()).digest(), insider._key):
        with pytest.raises(BootstrapError, match="HTTP 401"):
            register_prefill_rank("127.0.0.1", prefill.port, mine, auth=Authenticator(key))
    assert prefill.server.auth_rejected == 4
    assert fetch_prefill_info("127.0.0.1", prefill.port, auth=insider) == real  # the registry as it was
    recv = start_decode(stack, fabric=fabric, cfg=cfg)
    recv.add_room(7, "127.0.0.1", prefill.port, np.arange(6))
    sender.add_room(7, SRC)
    sender.send(7, 0, 22, last=True, aux=(5, -0.5))
    assert Results(recv).get(7)[1] is TransferState.SUCCESS
    assert Results(sender).get(7)[1] is TransferState.SUCCESS
