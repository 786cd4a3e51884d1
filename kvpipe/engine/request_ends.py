"""The end of a request: its connector's hold on its pages, its drafter's last work, the
scheduler's finish, an answer held back while a transfer owns its pages, and its rid given back.

Page rule (engine/connector.py): a finished request whose transfer may still write into (decode)
or read from (prefill) its pages keeps them, and its rid, until the connector reports the
transfer over. A normal finish of such a request is answered only then, when the transfer
succeeded; an abort is answered at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpipe.engine.connector import KVConnector
from kvpipe.engine.finish import FinishChecker
from kvpipe.engine.inbox import Inbox
from kvpipe.engine.outputs import step_output
from kvpipe.engine.request import FinishReason, Req, TokenOutput
from kvpipe.engine.sampler import RequestGenerators
from kvpipe.engine.scheduler import Scheduler
from kvpipe.engine.spec.drafter import Drafter
from kvpipe.engine.timeline import Phase

Finish = tuple[FinishReason, str | int | None]  # FinishChecker.check's verdict


@dataclass
class Held:
    """A finished request whose pages a transfer still owns."""

    req: Req
    replied: bool  # the client got its final output
    deferred: TokenOutput | None = None  # the normal finish, sent once the transfer succeeded


class RequestEnds:
    def __init__(
        self,
        scheduler: Scheduler,
        finisher: FinishChecker,
        generators: RequestGenerators,
        inbox: Inbox,
        connector: KVConnector | None,
        drafter: Drafter | None,
        cache_drafts: bool,
    ) -> None:
        """`cache_drafts`: a normal finish's full pages go to a prefix cache, so its drafter
        completes their draft KV first (Drafter.finish)."""
        self.scheduler = scheduler
        self.finisher = finisher
        self.generators = generators
        self.inbox = inbox
        self.connector = connector
        self.drafter = drafter
        self.cache_drafts = cache_drafts
        self.held: dict[str, Held] = {}

    def connector_holds(self, req: Req, reason: FinishReason, detail: str | int | None) -> bool:
        return self.connector is not None and self.connector.on_finish(req, reason, detail)

    def finish(self, req: Req, reason: FinishReason, detail: str | int | None) -> bool:
        """End `req`; True when a transfer keeps its pages (then they are freed at its
        TransferFinished, and a normal finish is answered then)."""
        hold = self.connector_holds(req, reason, detail)
        if self.drafter is not None and self.cache_drafts and reason is not FinishReason.ABORT:
            self.drafter.finish(req)  # its full pages go to the radix cache with their draft KV complete
        self.scheduler.finish(req, reason, detail, hold=hold)
        return self.settle(req, hold)

    def settle(self, req: Req, hold: bool) -> bool:
        """`req` was finished (by finish, or by the scheduler): remember it while a transfer
        `hold`s its pages, else forget it."""
        req.timeline.mark(Phase.FINISHED)
        if hold:  # its rid stays taken until the transfer lets go of its pages
            self.held[req.rid] = Held(req, replied=req.finish_reason is FinishReason.ABORT)
        self.forget(req.rid, release_rid=not hold)
        return hold

    def forget(self, rid: str, release_rid: bool = True) -> None:
        """Every end of a request passes here (finish, abort, failure); a transfer that holds the
        request (release_rid False) may still read or write its draft pages: freed at its end."""
        self.generators.forget(rid)
        if self.drafter is not None and release_rid:
            self.drafter.release(rid)
        self.finisher.forget(rid)
        if release_rid:
            self.inbox.release(rid)

    def answer(self, req: Req, fin: Finish | None, num_new: int, with_spec: bool = False) -> TokenOutput | None:
        """After a step appended `num_new` tokens to `req`: finish it when `fin` says so; its
        answer, or None when a transfer holds back a normal finish's answer until the KV landed."""
        held = self.finish(req, *fin) if fin is not None else False
        out = step_output(req, num_new, with_spec)
        if held and req.finish_reason is not FinishReason.ABORT:
            self.held[req.rid].deferred = out  # the client hears once the KV has landed
            return None
        return out
