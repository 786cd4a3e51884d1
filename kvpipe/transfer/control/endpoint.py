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

Bounds (issue 30): every socket has ZMQ_MAXMSGSIZE set from `limits` (codec.WireLimits: the
largest frame a legit peer can send this endpoint, plus the authentication header), so libzmq drops
the connection of a peer that announces a bigger frame before a byte of it is buffered; decoding
runs under the same limits. PUSH sockets are pooled: at most `max_sockets` stay open, the least
recently used one is closed when another is needed (`stats.sockets_closed`), so a flood of
distinct reply addresses cannot pile up sockets.
"""

from __future__ import annotations

import collections
import errno
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvpipe.config import ConfigError, PortRange
from kvpipe.transfer.control import messages
from kvpipe.transfer.control.auth import FRAME_OVERHEAD, Authenticator, AuthError
from kvpipe.transfer.control.codec import WireLimits

log = logging.getLogger(__name__)


@dataclass
class EndpointStats:
    received: int = 0
    malformed: int = 0  # frames that failed to decode, dropped
    handler_errors: int = 0  # decoded messages whose handler raised
    sent: int = 0
    send_dropped: int = 0  # peer queue full, peer unreachable or endpoint closed
    auth_rejected: int = 0  # frames without a valid tag, stale or replayed (with an Authenticator)
    sockets_closed: int = 0  # least recently used PUSH sockets closed to stay within max_sockets


def _tcp(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


def _bind_in(sock: zmq.Socket, host: str, ports: PortRange) -> int:
    """Bind `sock` to a free port of `ports` (tried in random order: endpoints of one server
    started at once then rarely race for the same one); ConfigError when every one is taken."""
    order = list(range(ports.first, ports.last + 1))
    random.shuffle(order)
    for port in order:
        try:
            sock.bind(f"{_tcp(host)}:{port}")
            return port
        except zmq.ZMQError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    raise ConfigError(f"no free port for a control endpoint in --disaggregation-control-ports {ports} on {host}")


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
        limits: WireLimits = messages.DEFAULT_LIMITS,
        max_sockets: int = 1024,
        ports: PortRange | None = None,
    ) -> None:
        if max_sockets < 1:
            raise ValueError("an endpoint needs at least one PUSH socket")
        self.name = name
        self._auth = auth
        self._limits = limits
        self._max_sockets = max_sockets
        # the socket refuses anything longer: the frame is never buffered, let alone authenticated
        self.max_frame_bytes = limits.max_frame_bytes + (FRAME_OVERHEAD if auth is not None else 0)
        self.stats = EndpointStats()
        self._handler = handler
        self._send_hwm = send_hwm
        self._poll_ms = poll_ms
        # Own context: closing this endpoint never touches another one in the same process.
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        if ":" in host:
            self._pull.setsockopt(zmq.IPV6, 1)
        try:
            port = self._pull.bind_to_random_port(_tcp(host)) if ports is None else _bind_in(self._pull, host, ports)
        except BaseException:
            self._pull.close(linger=0)
            self._ctx.term()
            raise
        self.address = f"{_tcp(host)}:{port}"
        self._push: collections.OrderedDict[str, zmq.Socket] = collections.OrderedDict()  # LRU last
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
                while len(self._push) >= self._max_sockets:
                    _, old = self._push.popitem(last=False)
                    old.close(linger=0)
                    self.stats.sockets_closed += 1
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, self._send_hwm)
                sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # a PUSH socket receives nothing
                if addr.startswith("tcp://["):
                    sock.setsockopt(zmq.IPV6, 1)
                try:
                    sock.connect(addr)
                except zmq.ZMQError as e:  # a malformed address from a peer's message
                    sock.close(linger=0)
                    self.stats.send_dropped += 1
                    log.warning("%s: cannot connect to %.200s: %s", self.name, addr, e)
                    return False
                self._push[addr] = sock
            else:
                self._push.move_to_end(addr)
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
                msg = messages.decode(payload, self._limits)
            except Exception as e:  # ProtocolError, or anything a hostile frame provokes
                self.stats.malformed += 1
                log.warning("%s: dropped malformed control message (%d bytes): %s", self.name, len(payload), e)
                continue
            try:
                self._handler(msg)
            except Exception:
                self.stats.handler_errors += 1
                log.exception("%s: handler failed on %s", self.name, type(msg).__name__)

    def num_sockets(self) -> int:
        """PUSH sockets open now (at most max_sockets)."""
        with self._lock:
            return len(self._push)

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
