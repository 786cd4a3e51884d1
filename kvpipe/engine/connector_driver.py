"""The engine's side of its KV connector, step by step: REMOTE requests waiting for the pages
of their prompt, transfer news (KVArrived, TransferFinished), and the answers of finished
requests whose pages a transfer still holds (engine/request_ends.py).

The engine owns the scheduler and the pages; this module calls the connector at the moments
engine/connector.py names and applies what it reports.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

from kvpipe.engine.connector import Admission, KVArrived, KVConnector, TransferFinished
from kvpipe.engine.finish import FinishChecker
from kvpipe.engine.outputs import abort_output, finish_output, step_output
from kvpipe.engine.request import ABORTED_ON_REQUEST, FinishReason, Req, TokenOutput
from kvpipe.engine.request_ends import RequestEnds
from kvpipe.engine.scheduler import Scheduler
from kvpipe.engine.spec.drafter import Drafter
from kvpipe.engine.timeline import Phase

logger = logging.getLogger(__name__)

# A REMOTE request waiting for free pages is retried this often when nothing else wakes the loop.
RESERVE_RETRY_S = 0.01


class ConnectorDriver:
    def __init__(
        self,
        connector: KVConnector,
        scheduler: Scheduler,
        ends: RequestEnds,
        finisher: FinishChecker,
        drafter: Drafter | None,
        waiting_timeout_s: float,
    ) -> None:
        """`waiting_timeout_s`: named in the abort of a REMOTE request that found no pages by its
        deadline (KVConnector.reserve_deadline_s)."""
        self.connector = connector
        self.scheduler = scheduler
        self.ends = ends
        self.finisher = finisher
        self.drafter = drafter
        self.waiting_timeout_s = waiting_timeout_s
        self._remote: deque[tuple[Req, float]] = deque()  # REMOTE requests waiting for pages, deadline

    def admit(self, req: Req, now: float) -> bool:
        """A new request: True when it is REMOTE (it waits here for the pages of its prompt)."""
        if self.connector.admit(req) is not Admission.REMOTE:
            return False
        self._remote.append((req, now + self.connector.reserve_deadline_s()))
        return True

    def step(self, outs: list[TokenOutput]) -> bool:
        """Reserve pages for REMOTE requests, apply transfer news; True when `outs` holds news
        (a first token that arrived with its KV goes out now, not after the next forward)."""
        self._reserve_remote(outs)
        self._poll(outs)
        return bool(outs)

    def waiting(self, rid: str) -> Req | None:
        """The REMOTE request `rid` while it waits for pages."""
        return next((r for r, _ in self._remote if r.rid == rid), None)

    @property
    def num_waiting(self) -> int:
        return len(self._remote)

    def wait_hint(self) -> float | None:
        """With nothing runnable: how long the engine loop may sleep (None: until new input)."""
        hint = self.connector.wait_hint()
        if self._remote:
            hint = RESERVE_RETRY_S if hint is None else min(hint, RESERVE_RETRY_S)
        return hint

    def abort_held(self, rid: str) -> TokenOutput | None:
        """The client gave up on `rid`: if it finished and its transfer still runs, stop the
        transfer and answer ABORT now (None: nothing of it is held, or it was answered)."""
        h = self.ends.held.get(rid)
        if h is None or h.replied:
            return None
        h.replied = True
        out = abort_output(h.req, ABORTED_ON_REQUEST)
        self.connector.abort_transfer(h.req, "client disconnected or request aborted")
        return out

    def _reserve_remote(self, outs: list[TokenOutput]) -> None:
        """Give REMOTE requests the pages of their prompt (FIFO, head of line) and let the
        connector ask for their KV; a request that finds no pages by its deadline fails."""
        now = time.monotonic()
        while self._remote:
            req, deadline = self._remote[0]
            if req.finished:
                self._remote.popleft()
                continue
            if not self.scheduler.reserve(req):
                if not req.finished and now < deadline:
                    return  # no room now: retry next step
                self._remote.popleft()
                if req.finished:  # it can never fit: the scheduler finished it with a message
                    self.ends.settle(req, self.ends.connector_holds(req, FinishReason.ABORT, req.finish_detail))
                else:
                    why = f"no free KV pages within the waiting timeout ({self.waiting_timeout_s}s)"
                    self.ends.finish(req, FinishReason.ABORT, why)
                outs.append(finish_output(req))
                continue
            self._remote.popleft()
            req.timeline.prefix_hit_tokens = req.num_shared_pages * self.scheduler.page_size
            if self.drafter is not None:  # the prompt's draft KV lands next to its KV
                self.drafter.on_reserved(req)
            try:
                self.connector.on_reserved(req)
            except ValueError as e:  # e.g. pages the transfer refuses: nothing was asked for
                self.ends.finish(req, FinishReason.ABORT, str(e))
                outs.append(finish_output(req))
                continue
            req.timeline.mark(Phase.PAGES_RESERVED)

    def _poll(self, outs: list[TokenOutput]) -> None:
        for ev in self.connector.poll():
            if isinstance(ev, KVArrived):
                self._kv_arrived(ev, outs)
                continue
            assert isinstance(ev, TransferFinished)
            h = self.ends.held.pop(ev.rid, None)
            if h is not None:  # pages are safe now
                self.scheduler.release(ev.rid)
                self.ends.forget(ev.rid)
                h.req.timeline.mark(Phase.RELEASED)
                if not h.replied:
                    outs.append(
                        replace(h.deferred, timeline=h.req.timeline.record())
                        if ev.ok and h.deferred is not None
                        else abort_output(h.req, f"KV transfer failed: {ev.reason}")
                    )
                continue
            req = self.scheduler.get(ev.rid)
            if req is not None and not ev.ok:  # still computing or waiting for its KV: stop it
                self.ends.finish(req, FinishReason.ABORT, f"KV transfer failed: {ev.reason}")
                outs.append(finish_output(req))

    def _kv_arrived(self, ev: KVArrived, outs: list[TokenOutput]) -> None:
        req = self.scheduler.get(ev.rid)
        if req is None or req.rid not in self.scheduler.reserved:
            logger.warning("KV arrived for %s, which is not waiting for it", ev.rid)
            return
        req.timeline.mark(Phase.KV_ARRIVED)
        req.timeline.mark(Phase.FIRST_TOKEN)
        req.output_ids.append(ev.first_token_id)
        req.output_logprobs.append(ev.first_token_logprob)
        if self.drafter is not None:
            try:
                self.drafter.kv_arrived(req, ev.draft_tokens, ev.draft_hidden)
            except ValueError as e:  # a peer the handshake let through should never send this
                logger.warning("request %s: the prefill's NEXTN state refused (%s); its drafts start cold", req.rid, e)
        # cached_tokens means what it means colocated: prompt tokens not computed (by the prefill);
        # the decode's own prefix (req.num_shared_pages) shows in the KV bytes not transferred
        req.cached_tokens = ev.prefill_cached_tokens
        self.scheduler.add_prefilled(req)  # its prompt's KV is verified: it may go to the prefix cache
        fin = self.finisher.check(req, 1)
        if fin is not None:
            self.ends.finish(req, *fin)
        outs.append(step_output(req, 1))
