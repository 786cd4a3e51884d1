"""Load for the kill -9 campaign: client coroutines streaming `/generate` through the router back
to back, each request ending in an Outcome (kvpipe/harness/driver.py) that says how it ended,
never silently hanging.

They run on an asyncio loop in a thread of their own, so a request's clock keeps running while
the campaign kills processes from its thread and the server a request waits on is gone. Every
request has the driver's deadline: one that would hang forever ends as TIMEOUT, the one end the
campaign counts as a failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import httpx

from kvpipe.harness.driver import new_client, send
from kvpipe.harness.outcome import End, Outcome
from kvpipe.harness.request import Request

# the ends a request in flight at a kill may have: every one but a hang (TIMEOUT); the campaign
# sends neither follow-up turns nor requests it disconnects itself
FINAL = (End.OK, End.ABORT, End.HTTP_ERROR, End.CONNECTION, End.CUT)


def generate(ids: list[int], max_tokens: int) -> Request:
    """A streamed native /generate request."""
    return Request(0, tuple(ids), max_tokens)


@dataclass
class Sent:
    """A request the campaign sent: what for, when (time.monotonic), the stream events it got so
    far, and its outcome once it ended (None: still running)."""

    purpose: str  # "load" or "probe"
    start: float
    events: int = 0
    outcome: Outcome | None = None

    @property
    def end(self) -> float | None:
        return None if self.outcome is None else self.outcome.end_s

    def in_flight_at(self, t: float) -> bool:
        return self.start <= t and (self.end is None or self.end > t)

    def describe(self) -> str:
        o = self.outcome
        return f"{self.purpose}: {o.end.value if o else 'running'} {o.reason if o else ''}".rstrip()


class Load:
    """`clients` coroutines sending short streamed requests back to back until stop(), plus the
    requests sent with send(); every one is in `snapshot()`. Bounded: at most `max_requests`
    per client."""

    def __init__(
        self,
        url: str,
        clients: int,
        seed: int,
        deadline_s: float,
        vocab: int = 256,
        max_requests: int = 10_000,
        extra: int = 1,
    ) -> None:
        """`extra`: how many requests sent with send() may run at once beside the clients'."""
        self.url, self.clients, self.seed, self.extra = url, clients, seed, extra
        self.deadline_s, self.vocab, self.max_requests = deadline_s, vocab, max_requests
        self._sent: list[Sent] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="chaos-load")
        self._tasks: list[concurrent.futures.Future[Any]] = []
        self._client: httpx.AsyncClient | None = None

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def __enter__(self) -> Load:
        self._thread.start()
        self._client = self._submit(self._new_client()).result()
        self._tasks += [
            self._submit(self._client_loop(random.Random(self.seed * 1000 + i))) for i in range(self.clients)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for t in self._tasks:
            t.cancel()  # a request that outlived stop()'s wait: its record stays without an outcome
        try:
            self._submit(self._shutdown()).result(10.0)
        except concurrent.futures.TimeoutError:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    async def _shutdown(self) -> None:
        """What asyncio.run does at its end: close the client, then the async generators a
        request left unfinished (a stream read up to [DONE] but not closed)."""
        if self._client is not None:
            await self._client.aclose()
        await asyncio.sleep(0)  # the generators' pending aclose() tasks run
        await self._loop.shutdown_asyncgens()

    async def _new_client(self) -> httpx.AsyncClient:
        return new_client(self.clients + self.extra, self.deadline_s, url=self.url)  # the clients and the sent ones

    def _record(self, purpose: str) -> Sent:
        rec = Sent(purpose, time.monotonic())
        with self._lock:
            self._sent.append(rec)
        return rec

    async def _send(self, rec: Sent, req: Request) -> Outcome:
        assert self._client is not None

        def on_event(n: int) -> None:
            rec.events = n

        rec.outcome = await send(self._client, self.url, req, self.deadline_s, clock=time.monotonic, on_event=on_event)
        return rec.outcome

    async def _client_loop(self, rng: random.Random) -> None:
        for _ in range(self.max_requests):
            if self._stopping.is_set():
                return
            ids = [rng.randrange(3, self.vocab) for _ in range(rng.randint(16, 400))]
            out = await self._send(self._record("load"), generate(ids, rng.randint(8, 48)))
            if not out.ok:
                await asyncio.sleep(0.2)  # the stack is recovering: do not spin on refused connections

    def send(self, purpose: str, req: Request) -> Sent:
        """Send `req` besides the load (from any thread); its record fills in as it runs."""
        rec = self._record(purpose)
        self._tasks.append(self._submit(self._send(rec, req)))
        return rec

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop sending; wait for the requests in flight (each ends by its deadline). True if all did."""
        self._stopping.set()
        end = time.monotonic() + (self.deadline_s + 5.0 if timeout_s is None else timeout_s)
        for t in self._tasks:
            try:
                t.result(max(0.0, end - time.monotonic()))
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                pass
        return all(t.done() for t in self._tasks)

    def snapshot(self) -> list[Sent]:
        with self._lock:
            return list(self._sent)
