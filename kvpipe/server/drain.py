"""Graceful drain: what a server does between SIGTERM and its exit (a rolling update, a scale-down,
`kubectl delete pod`, Ctrl-C).

    SERVING --signal--> DRAINING --nothing left--> DONE (exit 0)
                            \\--timeout--> ABORTING --pages and rooms settled (or settle_s)--> DONE

DRAINING: /health answers 503 `{"status": "draining"}` at once (the router and Kubernetes take the
server out of the pool), new requests get 503 with Retry-After, the requests in flight run on.
At --graceful-shutdown-timeout what is left is aborted: a stream ends with its final chunk
(finish reason abort, with DRAIN_DETAIL as the message), an error event and `[DONE]`; an answer not
streamed carries the same finish reason. The engine aborts them (a decode tells its prefill, a
prefill its decodes), and the server waits, bounded, until its pages and PD rooms are back before
it exits. SGLang answers /health with 503 while it drains too; it has no bound on the drain (only
SGL_FORCE_SHUTDOWN), which Kubernetes' terminationGracePeriodSeconds then cuts with SIGKILL.

`Drain` is the bookkeeping (no clock, no I/O: the caller passes `now`); `watch_drain` the loop task.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpipe.engine.request import FinishReason
from kvpipe.server.async_engine import AsyncEngine
from kvpipe.server.request_tracker import RequestOutput

logger = logging.getLogger(__name__)

DRAIN_TICK_S = 0.1
# after the aborts, the longest the server waits for its pages and rooms (a peer that never
# acknowledges an abort: the transfer timeout frees them later in a process that is gone anyway)
SETTLE_S = 10.0
DRAINING_REASON = "the server is shutting down (draining): send the request to another server"
DRAIN_DETAIL = "the server is shutting down: aborted at --graceful-shutdown-timeout"
DRAIN_LOG_PREFIX = "kvpipe drain: "  # the summary line's prefix (tests and operators read it)


class DrainPhase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # refusing new requests, the ones in flight running on
    ABORTING = "aborting"  # the timeout passed: the rest aborted, pages and rooms settling
    DONE = "done"  # nothing left: the server exits


class DrainAction(enum.Enum):
    NONE = "none"
    ABORT_ALL = "abort_all"
    EXIT = "exit"


@dataclass
class Drain:
    timeout_s: float  # --graceful-shutdown-timeout
    settle_s: float = SETTLE_S
    phase: DrainPhase = DrainPhase.SERVING
    started: float | None = None
    deadline: float | None = None  # when what is left gets aborted
    aborted_at: float | None = None
    in_flight: int = 0  # requests held when the drain began
    aborted: int = 0  # requests aborted at the deadline
    ended: float | None = None

    def begin(self, now: float) -> bool:
        """The first signal: start draining (True); a later one moves the deadline to now (False)."""
        if self.phase is DrainPhase.SERVING:
            self.phase, self.started, self.deadline = DrainPhase.DRAINING, now, now + self.timeout_s
            return True
        if self.phase is DrainPhase.DRAINING:
            self.deadline = now
        return False

    @property
    def draining(self) -> bool:
        return self.phase is not DrainPhase.SERVING

    def step(self, now: float, active: int, settled: bool) -> DrainAction:
        """The next action, given the requests still held (`active`) and whether the engine holds
        no request, page reservation or PD room any more (`settled`)."""
        if self.phase is DrainPhase.DRAINING:
            if active == 0 and settled:
                return self._done(now)
            assert self.deadline is not None
            if now >= self.deadline:
                self.phase, self.aborted_at, self.aborted = DrainPhase.ABORTING, now, active
                return DrainAction.ABORT_ALL
        elif self.phase is DrainPhase.ABORTING:
            assert self.aborted_at is not None
            if (active == 0 and settled) or now >= self.aborted_at + self.settle_s:
                return self._done(now)
        return DrainAction.NONE

    def _done(self, now: float) -> DrainAction:
        self.phase, self.ended = DrainPhase.DONE, now
        return DrainAction.EXIT

    def summary(self, stats: dict[str, Any] | None) -> dict[str, Any]:
        """What the exit line reports: the drain's times and counts, the engine's pages and rooms."""
        assert self.started is not None and self.ended is not None
        s = stats or {}
        pd = s.get("disaggregation") or {}
        return {
            "seconds": round(self.ended - self.started, 3),
            "in_flight": self.in_flight,
            "finished": self.in_flight - self.aborted,
            "aborted": self.aborted,
            "timed_out": self.aborted_at is not None,
            "settled": engine_settled(stats),
            "free_pages": s.get("free_pages"),
            "total_pages": s.get("total_pages"),
            "active_rooms": pd.get("active_rooms"),
            "transfer_rooms": pd.get("transfer_rooms"),
        }


_BUSY_KEYS = ("num_running", "num_waiting", "num_reserved", "num_held")


def engine_settled(stats: dict[str, Any] | None) -> bool:
    """The engine holds nothing any more: no request running, waiting, holding pages for a peer,
    and no PD room (None: no engine loaded, nothing to wait for)."""
    if stats is None:
        return True
    if any(stats.get(k) for k in _BUSY_KEYS):
        return False
    pd = stats.get("disaggregation") or {}
    return not pd.get("active_rooms") and not pd.get("transfer_rooms")


def is_drain_abort(out: RequestOutput) -> bool:
    return out.finish_reason is FinishReason.ABORT and out.finish_detail == DRAIN_DETAIL


@dataclass
class DrainControl:
    """A server's drain: the signal side (`signal`, from the handler) and the loop task (`watch`)."""

    drain: Drain
    engine: AsyncEngine
    exit_server: Callable[[], None] = lambda: None  # set by run_server: uvicorn's should_exit
    _begun: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)

    def signal(self) -> None:
        """A SIGTERM or Ctrl-C (main thread, the loop's): refuse new work now, wake the watcher."""
        now = time.monotonic()
        if self.drain.begin(now):
            self.drain.in_flight = self.engine.num_active()
            self.engine.refuse_new(DRAINING_REASON)
            logger.warning(
                "shutting down: draining %d requests (at most %g s, --graceful-shutdown-timeout); "
                "/health answers 503, new requests 503 with Retry-After",
                self.drain.in_flight,
                self.drain.timeout_s,
            )
            if self._loop is not None:  # a signal handler may run inside the loop's own code
                self._loop.call_soon_threadsafe(self._begun.set)
            else:
                self._begun.set()
        else:
            logger.warning("second signal: aborting what is left now")

    async def watch(self) -> None:
        """Drive the drain once a signal began it; ask the server to exit when it is done."""
        self._loop = asyncio.get_running_loop()
        await self._begun.wait()
        while True:
            action = self.drain.step(time.monotonic(), self.engine.num_active(), engine_settled(self.engine.stats()))
            if action is DrainAction.ABORT_ALL:
                n = self.engine.abort_all_for(DRAIN_DETAIL)
                logger.warning("graceful shutdown timeout: %d requests aborted", n)
            elif action is DrainAction.EXIT:
                logger.info(DRAIN_LOG_PREFIX + json.dumps(self.drain.summary(self.engine.stats())))
                self.exit_server()
                return
            await asyncio.sleep(DRAIN_TICK_S)
