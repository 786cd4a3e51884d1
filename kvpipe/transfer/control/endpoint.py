"""ZeroMQ control-plane endpoint: one PULL socket in, one lazily created PUSH socket per peer out.

    ep = ControlEndpoint("127.0.0.1", handler, name="prefill-0")
    ep.start()                      # binds tcp://127.0.0.1:<free port>, starts the receive thread
    ep.address                      # what peers send to
    ep.send("tcp://h:p", message)   # never blocks: False (and counted) if it could not be queued
    ep.close()

Messages are the typed dataclasses of messages.py; `handler(msg)` runs on the receive
thread. A frame that does not decode is logged and dropped (`stats.malformed`); an exception in
the handler is logged (`stats.handler_errors`); neither stops the endpoint. PUSH sockets use
linger 0 and NOBLOCK sends, so a dead or slow peer fills at most `send_hwm` messages and then
sends to it fail fast instead of blocking a server loop. `send` is thread-safe.

With an `Authenticator` (auth.py) every frame is sealed for the destination address and every
received frame must carry a valid tag for this endpoint's address, a fresh timestamp and an unseen
nonce; a frame that fails is dropped before it is decoded (`stats.auth_rejected`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvpipe.transfer.control import messages
from kvpipe.transfer.control.auth import Authenticator, AuthError

log = logging.getLogger(__name__)


@dataclass
class EndpointStats:
    received: int = 0
    malformed: int = 0  # frames that failed to decode, dropped
    handler_errors: int = 0  # decoded messages whose handler raised
    sent: int = 0
    send_dropped: int = 0  # peer queue full, peer unreachable or endpoint closed
    auth_rejected: int = 0  # frames without a valid tag, stale or replayed (with an Authenticator)


def _tcp(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


class ControlEndpoint:
    def __init__(
        self,
        host: str,
        handler: Callable[[Any], None],
        *,
        name: str = "control",
        send_hwm: int = 10000,
        poll_ms: int = 20,
        auth: Authenticator | None = None,
    ) -> None:
        self.name = name
        self._auth = auth
        self.stats = EndpointStats()
        self._handler = handler
        self._send_hwm = send_hwm
        self._poll_ms = poll_ms
        # Own context: closing this endpoint never touches another one in the same process.
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._pull.setsockopt(zmq.IPV6, 1)
        port = self._pull.bind_to_random_port(_tcp(host))
        self.address = f"{_tcp(host)}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()  # guards _push (zmq sockets are not thread-safe)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self._closed = False

    def start(self) -> ControlEndpoint:
        self._thread.start()
        return self

    def send(self, addr: str, msg: Any) -> bool:
        """Queue `msg` to the peer at `addr` without blocking. Returns False if it was dropped."""
        data = messages.encode(msg)
        if self._auth is not None:
            data = self._auth.seal(data, addr.encode())
        with self._lock:
            if self._closed:
                self.stats.send_dropped += 1
                return False
            sock = self._push.get(addr)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, self._send_hwm)
                if addr.startswith("tcp://["):
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(addr)
                self._push[addr] = sock
            try:
                sock.send(data, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.stats.send_dropped += 1
                log.warning("%s: control queue to %s full, message dropped", self.name, addr)
                return False
            except zmq.ZMQError as e:
                self.stats.send_dropped += 1
                log.warning("%s: send to %s failed: %s", self.name, addr, e)
                return False
            self.stats.sent += 1
            return True

    def disconnect(self, addr: str) -> None:
        """Drop the PUSH socket to a peer (e.g. declared dead); a later send reconnects."""
        with self._lock:
            sock = self._push.pop(addr, None)
            if sock is not None:
                sock.close(linger=0)

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(self._poll_ms):
                    continue
                frame = self._pull.recv(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                log.error("%s: receive failed: %s", self.name, e)
                continue
            self.stats.received += 1
            payload: bytes | memoryview = frame
            if self._auth is not None:
                try:
                    payload = self._auth.open(frame, self.address.encode())
                except AuthError as e:
                    self.stats.auth_rejected += 1
                    # the first few in full, then every 1000th: a flood must not flood the log
                    if self.stats.auth_rejected <= 10 or self.stats.auth_rejected % 1000 == 0:
                        log.warning(
                            "%s: rejected control frame (%d bytes, %d rejected so far): %s",
                            self.name,
                            len(frame),
                            self.stats.auth_rejected,
                            e,
                        )
                    continue
            try:
                msg = messages.decode(payload)
            except Exception as e:  # ProtocolError, or anything a hostile frame provokes
                self.stats.malformed += 1
                log.warning("%s: dropped malformed control message (%d bytes): %s", self.name, len(payload), e)
                continue
            try:
                self._handler(msg)
            except Exception:
                self.stats.handler_errors += 1
                log.exception("%s: handler failed on %s", self.name, type(msg).__name__)

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        with self._lock:
            self._closed = True
            for sock in self._push.values():
                sock.close(linger=0)
            self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> ControlEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
