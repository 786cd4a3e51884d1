"""Load for the kill -9 campaign: client threads streaming `/generate` through the router, each
request ending in one final status that says how it ended (never silently hanging).

Plain threads and blocking httpx: the driver kills processes from its own thread meanwhile, and a
request's clock must keep running while the server it waits on is gone. Every request has a hard
deadline (httpx's per-read timeout plus a wall-clock check between events), so a request that
would hang forever shows up as TIMEOUT, the one status the campaign counts as a failure.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import httpx

from kvpipe.bench.client import DONE, event_error, event_tokens, parse_sse_line


class Status(Enum):
    OK = "ok"  # every token it asked for, then [DONE]
    ABORT = "abort"  # the server ended it with finish_reason abort or an error event
    HTTP_ERROR = "http_error"  # a non-200 answer (the router or a server refused or failed it)
    CONNECTION = "connection_error"  # the connection broke or was refused
    CUT = "cut"  # the stream ended without a final event
    TIMEOUT = "timeout"  # no final status within the deadline: a hang


FINAL = tuple(s for s in Status if s is not Status.TIMEOUT)


@dataclass
class Outcome:
    """One request: when it ran and how it ended (status None while running)."""

    kind: str  # what the request was for ("load", "probe", "check")
    start: float
    end: float | None = None
    status: Status | None = None
    detail: str = ""
    events: int = 0  # stream events received

    def finish(self, status: Status, detail: str = "") -> None:
        self.status, self.detail, self.end = status, detail[:300], time.monotonic()

    def in_flight_at(self, t: float) -> bool:
        return self.start <= t and (self.end is None or self.end > t)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "status": None if self.status is None else self.status.value,
            "detail": self.detail,
            "events": self.events,
            "duration_s": None if self.end is None else round(self.end - self.start, 3),
        }


def body(input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    return {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }


def stream_request(
    url: str,
    payload: dict[str, Any],
    out: Outcome,
    deadline_s: float,
    on_event: Callable[[Outcome], None] | None = None,
) -> Outcome:
    """POST a streamed /generate to `url` (a server root) and record how it ended in `out`."""
    want = payload["sampling_params"]["max_new_tokens"]
    end_by = out.start + deadline_s
    last: dict[str, Any] = {}
    try:
        with httpx.stream("POST", url + "/generate", json=payload, timeout=httpx.Timeout(deadline_s)) as r:
            if r.status_code != 200:
                out.finish(Status.HTTP_ERROR, f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
                return out
            for line in r.iter_lines():
                if time.monotonic() > end_by:
                    out.finish(Status.TIMEOUT, f"still streaming after {deadline_s:g} s")
                    return out
                ev = parse_sse_line(line)
                if ev is None:
                    continue
                if ev is DONE:
                    got = event_tokens(last)
                    if got == want:
                        out.finish(Status.OK)
                    else:
                        out.finish(Status.ABORT, f"ended after {got} of {want} tokens")
                    return out
                out.events += 1
                error = event_error(ev)
                if error is not None:
                    out.finish(Status.ABORT, error)
                    return out
                last = ev
                if on_event is not None:
                    on_event(out)
        out.finish(Status.CUT, f"stream ended after {out.events} events without [DONE]")
    except httpx.TimeoutException as e:
        out.finish(Status.TIMEOUT, f"{type(e).__name__} after {deadline_s:g} s")
    except (httpx.TransportError, httpx.StreamError) as e:
        out.finish(Status.CONNECTION, f"{type(e).__name__}: {e}")
    except ValueError as e:  # a malformed event
        out.finish(Status.CUT, f"malformed event: {e}")
    return out


class Load:
    """`clients` threads sending short streamed requests back to back until stop(); every request
    they sent is in `outcomes`. Bounded: at most `max_requests` per client."""

    def __init__(
        self, url: str, clients: int, seed: int, deadline_s: float, vocab: int = 256, max_requests: int = 10_000
    ) -> None:
        self.url, self.deadline_s, self.vocab, self.max_requests = url, deadline_s, vocab, max_requests
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._client, args=(random.Random(seed * 1000 + i),), daemon=True, name=f"chaos-load-{i}"
            )
            for i in range(clients)
        ]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _client(self, rng: random.Random) -> None:
        for _ in range(self.max_requests):
            if self._stop.is_set():
                return
            out = Outcome("load", time.monotonic())
            with self._lock:
                self.outcomes.append(out)
            ids = [rng.randrange(3, self.vocab) for _ in range(rng.randint(16, 400))]
            stream_request(self.url, body(ids, rng.randint(8, 48)), out, self.deadline_s)
            if out.status is not Status.OK:
                self._stop.wait(0.2)  # the stack is recovering: do not spin on refused connections

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop sending; wait for the requests in flight (each ends by its deadline). True if all did."""
        self._stop.set()
        end = time.monotonic() + (self.deadline_s + 5.0 if timeout_s is None else timeout_s)
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)
