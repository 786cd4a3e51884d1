"""Slow and too many HTTP clients on a uvicorn server: a request read deadline and a connection cap.

uvicorn (0.54, h11) bounds the time between requests on a kept-alive connection
(`timeout_keep_alive`) and answers 503 past `limit_concurrency`, but only once a request's headers
are complete: a client that connects and sends nothing, or one header byte a second, holds its
socket forever (issue 45, finding 7: 1,050 such connections held 1,023 descriptors of a bootstrap
server for 70 s). An ASGI middleware cannot help, it runs after the headers. So this is a
subclass of uvicorn's own h11 protocol, the real listener, with two rules:

- a connection must deliver a complete request (headers and body) within `request_read_s` of its
  start, or of the first byte of its next request on a kept-alive connection; else it gets
  408 and is closed (the time between requests stays uvicorn's `timeout_keep_alive`, the time
  the application takes is not limited here);
- at most `max_connections` are open. At the cap a new connection takes the place of the one that
  has waited longest for the rest of its request (it gets 408 and is closed): a slow client holds
  a slot only until newer ones need it, and a genuine client, which sends its request at once, is
  served however many slow ones there are. Only when every open connection has a whole request
  in (the application is busy with all of them) does a new one get 503 and is closed at once,
  before h11 reads a byte of it. Descriptors stay bounded whatever arrives (a burst adds at most
  one accept queue's worth, `max_connections` too, until the loop's next turn closes them).

Headers are bounded by h11's `max_incomplete_event_size` (uvicorn's `h11_max_incomplete_event_size`,
16 KiB), bodies by BodyLimitMiddleware.

    config = uvicorn.Config(app, **uvicorn_settings(ClientLimits()))
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_503 = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True)
class ClientLimits:
    max_connections: int = 256  # open connections; one more gets 503 and is closed
    request_read_s: float = 10.0  # a request's headers and body, from its first byte (or the connection's start)
    keep_alive_s: float = 5.0  # idle between two requests of a kept-alive connection (uvicorn's)
    max_header_bytes: int = 16 << 10  # h11's incomplete-event bound: the request line and headers

    def __post_init__(self) -> None:
        if self.max_connections < 1 or not self.request_read_s > 0 or not self.keep_alive_s > 0:
            raise ValueError(f"client limits must be positive: {self}")


def guarded_protocol(limits: ClientLimits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the request read deadline and the connection cap of `limits`."""

    class Guarded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _reading_since = 0.0  # when the request being read started (its deadline's start)
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections and not self._make_room():
                self._refused = True
                transport.write(_503)
                transport.close()
                return
            super().connection_made(transport)
            self._arm()

        def _make_room(self) -> bool:
            """Close the open connection that has waited longest for its request; False if none is
            waiting (every one has its request in)."""
            waiting = [c for c in self.connections if isinstance(c, Guarded) and c._deadline is not None]
            if not waiting:
                return False
            min(waiting, key=lambda c: c._reading_since)._expire()
            return True

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self.conn.their_state is h11.DONE or self.transport.is_closing():
                self._disarm()  # a whole request is in: the application's time is its own
            elif self._deadline is None:
                self._arm()  # the first bytes of the next request on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._reading_since = self.loop.time()
            self._deadline = self.loop.call_later(limits.request_read_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._disarm()
            if self.transport.is_closing() or self.conn.their_state is h11.DONE:
                return
            if self.conn.our_state is h11.IDLE:
                self.transport.write(_408)
            self.transport.close()

    return Guarded


def uvicorn_settings(limits: ClientLimits) -> dict[str, Any]:
    """uvicorn.Config keyword arguments that apply `limits` (the protocol, keep-alive, the
    concurrency cap that answers 503 to requests past it, the header bound)."""
    return {
        "http": guarded_protocol(limits),
        "timeout_keep_alive": limits.keep_alive_s,
        # uvicorn counts the connection a request came on: past the cap it never admitted one
        "limit_concurrency": limits.max_connections + 1,
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        # the kernel's accept queue, and what asyncio accepts in one go: a burst of connections
        # past the cap costs descriptors only until the next turn of the loop closes them
        "backlog": limits.max_connections,
    }
