"""uvicorn's HTTP/1.1 protocol with read deadlines and a connection cap against slow and too many
clients: the one listener of the HTTP server and of the prefill's bootstrap server (issue 45,
finding 7: 1,050 slowloris connections, each sending a header byte now and then, held 1,023
descriptors of a bootstrap server for 70 s).

uvicorn 0.54 bounds neither: a connection that never completes its request head is never cut
(`timeout_keep_alive` starts only after a response), nor one that trickles its body, and its
`limit_concurrency` answers 503 only once a request's head has arrived, so a connection that
never sends one holds its descriptor past the cap. An ASGI middleware cannot help: it runs after
the head. So this is a subclass of uvicorn's own h11 protocol, the real listener. Per connection:
- the head must be complete `header_timeout_s` after the connection opened (or after the first
  byte of the next request on a kept-alive connection; the idle time before it is uvicorn's
  `timeout_keep_alive`), else the client gets 408 and the connection is closed;
- the body must be complete `body_timeout_s` after the head, plus one second for every
  BODY_MIN_RATE bytes it has sent (a large body on a slow but honest link keeps going), else the
  connection is closed (the app sees the client leave).
Nothing is timed once a request has been read: a response may stream as long as it likes.

At `max_connections` open connections a new one takes the place of the one that has waited
longest for its client (reading a request, or idle between two): that one is closed (408 if it
was in a head). A slowloris holds a slot only until newer connections need it, and a genuine
client, which sends its request at once, is served however many slow ones there are (a cap that
refused newcomers instead let 200 slow heads lock every genuine client out until their deadline;
tests/integration/test_server_slow_clients.py). Only when every open connection has a whole
request in the application does a new one get 503 with Retry-After at once; it is closed as soon
as its first bytes are read (within REFUSED_LINGER_S, so the close sends no reset before the 503
arrives). Descriptors stay bounded whatever arrives: the accept backlog is the cap, so a burst
adds at most one backlog's worth until the loop's next turn closes the evicted ones.

Headers are bounded by h11's `max_incomplete_event_size` (`ListenerLimits.max_header_bytes`),
bodies by BodyLimitMiddleware (body_limit.py). The limits come from kvpipe/config/server.py
`ListenerLimits`: the server's flags (commands/http_flags.py) and the bootstrap server's fixed
BOOTSTRAP_LISTENER_LIMITS (transfer/control/bootstrap.py).

    config = uvicorn.Config(app, **listener_settings(limits), ...)
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpipe.config import ListenerLimits

logger = logging.getLogger(__name__)

BODY_MIN_RATE = 64 << 10  # bytes/s a body keeps its deadline moving by
REFUSED_LINGER_S = 1.0  # a refused connection waits this long at most for its request to read


def _raw_response(status: str, message: str, extra: str = "") -> bytes:
    code = int(status[:3])
    kind = "service_unavailable" if code == 503 else "request_timeout"
    body = json.dumps({"error": {"message": message, "type": kind, "code": code}})
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{extra}\r\n"
    )
    return head.encode() + body.encode()


def _refused(cap: int) -> bytes:
    return _raw_response(
        "503 Service Unavailable",
        f"the server is busy with {cap} requests, the most it holds connections for",
        "retry-after: 1\r\n",
    )


TIMED_OUT = _raw_response("408 Request Timeout", "the request head did not arrive in time")


class Phase(enum.Enum):
    HEAD = "head"  # reading a request head: header_timeout_s
    BODY = "body"  # reading its body: body_timeout_s + bytes / BODY_MIN_RATE
    NONE = "none"  # the request is read (or none has started on a kept-alive connection)


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with read deadlines and an evicting connection cap; `limits` is set by
    `protocol_class` (uvicorn builds one instance per connection from the class)."""

    limits: ClassVar[ListenerLimits] = ListenerLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase, self._timer, self._since = Phase.NONE, None, self.loop.time()
        self._refused = len(self.connections) >= self.limits.max_connections and not self._make_room()
        if self._refused:
            self.transport = transport
            transport.write(_refused(self.limits.max_connections))
            self._timer = self.loop.call_later(REFUSED_LINGER_S, transport.close)
            logger.debug("connection refused: all %d connections have a request in", len(self.connections))
            return
        super().connection_made(transport)
        self._arm(Phase.HEAD, self.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # its request is read (so the close sends no reset before the 503 arrives)
            self.transport.close()
            return
        super().data_received(data)
        self._follow(len(data))

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._refused:
            super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._since = self.loop.time()  # waiting for the client again (its next request)
        self._follow(0)  # a pipelined request may have been read meanwhile

    # ---- the cap ---------------------------------------------------------------------------------
    @property
    def waits_for_client(self) -> bool:
        """Reading a request, or idle between two: nothing of the application's is lost by closing it."""
        if self._refused or self.transport.is_closing():
            return False
        if self._phase is not Phase.NONE:
            return True
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _make_room(self) -> bool:
        """Close the open connection that has waited longest for its client; False when none waits
        (every one has a request in the application)."""
        waiting = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c.waits_for_client]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c._since)
        logger.debug("%s evicted for a new connection (%s)", oldest.client, oldest._phase.value)
        oldest._expired(oldest._phase)
        return True

    # ---- the deadlines ---------------------------------------------------------------------------
    def _follow(self, n: int) -> None:
        """Move the deadline with what h11 has read of the client's request."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._phase is not Phase.HEAD and n:  # the first bytes of the next request's head
                self._arm(Phase.HEAD, self.limits.header_timeout_s)
        elif state is h11.SEND_BODY:
            if self._phase is not Phase.BODY:
                self._body_deadline = self.loop.time() + self.limits.body_timeout_s
                self._arm(Phase.BODY, self.limits.body_timeout_s)
            elif n:
                self._body_deadline += n / BODY_MIN_RATE
                self._arm(Phase.BODY, self._body_deadline - self.loop.time())
        else:  # DONE, MUST_CLOSE, CLOSED, ERROR: nothing more to read
            self._disarm()

    def _arm(self, phase: Phase, delay: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(max(delay, 0.0), self._expired, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = Phase.NONE

    def _expired(self, phase: Phase) -> None:
        """Its deadline passed, or it was evicted: close it (with a 408 in a head)."""
        self._disarm()
        if self.transport.is_closing():
            return
        logger.debug("%s: request %s not read in time, connection closed", self.client, phase.value)
        if phase is Phase.HEAD and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(TIMED_OUT)  # nothing else was said on it: a 408 is well-formed
        self.transport.close()


def protocol_class(limits: ListenerLimits) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol with `limits` (one class per server: no limits shared between them)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def listener_settings(limits: ListenerLimits) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for a guarded listener."""
    return {
        "http": protocol_class(limits),
        "timeout_keep_alive": limits.keep_alive_s,
        # uvicorn's own cap (503 after a request head) would also count the connections being
        # refused above: the cap is enforced at accept instead
        "limit_concurrency": None,
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        # the kernel's accept queue, and what asyncio accepts in one turn of the loop: a burst
        # past the cap costs descriptors only until that turn's evictions are closed
        "backlog": limits.max_connections,
    }
