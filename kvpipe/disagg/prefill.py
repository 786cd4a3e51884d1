"""`PrefillConnector`: the engine's KV connector for `--disaggregation-mode prefill` (any TP size).

Per request, keyed by its bootstrap_room (the request flow is in docs/architecture.md):
- claim: the room must be given and unused; the request runs with max_new_tokens = 1 (the
  decode generates the rest), its whole prompt's pages allocated at its first chunk;
- first prefill forward: the room starts on every rank with that page table (PrefillStep.start);
  the layer-group count comes from the LayerPipeline (cost model, or the fixed flag); with N > 1
  every rank sends each finished layer group of the batch's rows from its own hook;
- after each step: every rank sends the finished chunk (full pages; a partial page waits), or,
  when the prompt is complete, the rest with aux = (first token, logprob) (SendChunks);
- the engine's finish holds the pages (on_finish -> True) and its answer waits for the transfer;
  every rank reports the room through its worker; when all did (tally.py) the engine gets a
  TransferFinished: Success sends the held answer, Failed an ABORT. Pages are freed then only.
A prefill-side failure (rejected prompt, forward error, abort, client gone) fails the room on
every rank (FailRooms), so the decode hears of it at once. The first rank to fail a room makes
the others stop it (AbortRooms); a rank that exited fails every room it had not reported.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvpipe.config import ServerConfig
from kvpipe.disagg.commands import (
    AbortRooms,
    ChunkSend,
    FailRooms,
    PrefillStep,
    RankReport,
    RoomStart,
    SendChunks,
    StartPrefill,
)
from kvpipe.disagg.layer_groups import LayerGroupPolicy
from kvpipe.disagg.layer_pipeline import LayerPipeline
from kvpipe.disagg.pd_connector import PDConnector
from kvpipe.disagg.refusals import RefusedRooms, refusal_reason
from kvpipe.disagg.setup import TRANSFER_POLL_S, bootstrap_host, require_auth_off_loopback
from kvpipe.disagg.tally import RoomTally
from kvpipe.disagg.timeline_events import record_transfer
from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.connector import (
    Admission,
    ConnectorContext,
    ConnectorEvent,
    ForwardPlan,
    TransferFinished,
    WorkerGroup,
)
from kvpipe.engine.request import FinishReason, Req
from kvpipe.model.checkpoint.identity import checkpoint_digest
from kvpipe.transfer.backends.base import TransferBackend
from kvpipe.transfer.control.auth import authenticator
from kvpipe.transfer.control.bootstrap import BootstrapServer
from kvpipe.transfer.control.handshake import Handshake, RefusalNotice
from kvpipe.transfer.control.messages import room_claim
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.planning.wire_bytes import KVWireBytes
from kvpipe.transfer.sender.stats import SenderStats

logger = logging.getLogger(__name__)

SUMMED_STATS = (
    "rejected_messages",
    "batches_submitted",
    "batches_failed",
    "ops_submitted",
    "bytes_written",
    "staged_chunks",
    "staged_bytes",
    "auth_rejected",
    "foreign_rejected",
    "orphans_refused",
    "tombstones_evicted",
)


def _swa(req: Req) -> np.ndarray | None:
    """A snapshot of the sliding layers' page table (sliding-window models), else None."""
    return req.swa_pages.copy() if req.swa_pages.size else None


@dataclass
class _Room:
    """Engine-thread bookkeeping of one request on the prefill."""

    req: Req
    started: bool = False  # the ranks got its page table (or its failure)
    engine_done: bool = False  # the engine finished the request
    transfer_done: bool = False  # every rank reported the room (or it never reached them)
    forward_done_at: float | None = None  # time.monotonic() when its last prefill forward ended

    @property
    def room(self) -> int:
        assert self.req.bootstrap_room is not None
        return self.req.bootstrap_room

    @functools.cached_property
    def claim(self) -> bytes:
        """What only the decode this request was sent to can name (messages.room_claim)."""
        return room_claim(self.room, self.req.input_ids)


class PrefillConnector(PDConnector):
    side = "prefill"
    whole_prompt_pages = True
    # a cached prefix is not computed again; the transfer reads its pages like any other (the
    # request pins them while it is held) and sends from the decode's prefix_len on
    prefix_cache = True
    state_snapshots = True  # it computes prompts: a hybrid model's cache snapshots their states
    verifies_drafts = False  # the decode verifies; a prefill samples the first token only
    drafts_on_prefill = True  # the draft's KV of each chunk goes with the target's

    def __init__(self, cfg: ServerConfig, backend: TransferBackend | None = None) -> None:
        super().__init__(cfg, backend)
        self._rooms: dict[int, _Room] = {}  # engine thread only
        self._by_rid: dict[str, _Room] = {}
        self._piped: tuple[ChunkSend, ...] = ()  # rows of the forward in flight sent group by group
        self._rank_stats: dict[int, SenderStats] = {}
        self._succeeded = self._failed = 0
        self.bootstrap: BootstrapServer | None = None
        self._workers: WorkerGroup | None = None
        self._tally: RoomTally | None = None
        self.pipeline: LayerPipeline | None = None
        self.kv_wire: KVWireBytes | None = None  # KV bytes a chunk puts on the wire (set in start)
        d = cfg.disaggregation
        # rooms decodes refused our handshake for (bootstrap thread -> engine thread)
        self.refused = RefusedRooms(d.bootstrap_timeout_s + d.waiting_timeout_s)
        self.handshake: Handshake | None = None  # ours, set in start
        self._wake: Callable[[], None] = lambda: None

    # ---- set-up --------------------------------------------------------------------------------
    def start(self, ctx: ConnectorContext) -> None:
        d = self.cfg.disaggregation
        self._workers = ctx.workers
        self._tally = RoomTally(ctx.workers.tp_size)
        require_auth_off_loopback(self.cfg)
        self._wake = ctx.wake
        self._attach_draft(ctx)
        if self.local_worker is not None:  # computed once, at load
            self.handshake = self.local_worker.handshake(checkpoint_digest(self.cfg.model_path))
        host = bootstrap_host(self.cfg)
        instance, registrar = uuid.uuid4().hex[:12], secrets.token_bytes(32)  # only our ranks register
        self.bootstrap = BootstrapServer(
            host,
            d.bootstrap_port,
            authenticator(d.auth_token),
            on_refusal=self._on_refusal,
            registrar_key=registrar,
            prefill_instance=instance,
        ).start()
        reg_host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
        start = StartPrefill(instance, (reg_host, self.bootstrap.port), self.handshake, registrar)
        if self.local_worker is not None:
            # a finished room ends the loop's poll-interval sleep at once: its held answer is what
            # sglang-router waits for before it streams the decode's first token (traced)
            self.local_worker.on_news = ctx.wake
        self._start_ranks(ctx.workers, start)
        layout = self.ranks[0].layout
        state = self.ranks[0].state
        self.pipeline = LayerPipeline(
            replace(LayerGroupPolicy.parse(d.layer_groups), min_tokens=d.layer_groups_min_tokens),
            ctx.model_config.num_layers,
            layout.token_nbytes,
            state_nbytes=0 if state is None else state.slot_nbytes,
        )
        # sliding-window layers send only the prompt's last window: the planner's T counts that
        self.kv_wire = KVWireBytes.from_layout(layout, ctx.model_config.sliding_window)
        draft = self.local_worker.draft_layout if self.local_worker is not None else None
        if draft is not None:  # a STANDALONE draft model's KV goes with every chunk too (the last layer group)
            self.kv_wire = replace(self.kv_wire, full_token_nbytes=self.kv_wire.full_token_nbytes + draft.token_nbytes)
        logger.info(
            "prefill ready: bootstrap port %d, control %s, data %s",
            self.bootstrap.port,
            self.ranks[0].control_address,
            self.ranks[0].data_address,
        )

    @property
    def bootstrap_port(self) -> int:
        assert self.bootstrap is not None
        return self.bootstrap.port

    # ---- admission -----------------------------------------------------------------------------
    def claim(self, req: Req) -> None:
        room = req.bootstrap_room
        if room is None:
            raise ValueError(
                "a prefill server needs bootstrap_room (and bootstrap_host/port) with every "
                "request; send requests through sglang-router --pd-disaggregation"
            )
        self._claim_room(room)
        req.params = replace(req.params, max_new_tokens=1)  # the decode server generates the rest

    def admit(self, req: Req) -> Admission:
        r = _Room(req)
        self._rooms[r.room] = r
        self._by_rid[req.rid] = r
        why = self.refused.pop(r.room, r.claim)
        if why is not None:  # the decode refused our handshake before the request came here
            self._fail_room(r, why)  # answered like one refused later (SGLang's abort, the reason)
        return Admission.LOCAL

    def _on_refusal(self, notice: RefusalNotice) -> None:
        """Bootstrap server thread: a decode refused our handshake for these rooms. A room a decode
        asked for already (bound on rank 0, which every decode asks) was not refused by its own
        decode, which registered: such a notice is ignored, and a room counts as refused only with
        its request's claim (messages.room_claim, checked where the room's request is known:
        RefusedRooms.pop), so a notice cannot fail another decode's transfer (as an Abort from a
        session the room is not bound to cannot, issue 45)."""
        sender = self.local_worker.sender if self.local_worker is not None else None
        rooms = [room for room in notice.rooms if sender is None or not sender.is_bound(room)]
        if len(rooms) < len(notice.rooms):
            logger.warning("ignored a refusal of %d rooms a decode asked for", len(notice.rooms) - len(rooms))
        if not rooms:
            return
        reason, label = refusal_reason(notice, self.handshake)
        logger.warning("decode refused %d rooms: %s", len(rooms), reason)
        claims = dict(zip(notice.rooms, notice.claims))
        self.refused.add(rooms, reason, label, [claims.get(room) for room in rooms])
        self._wake()

    # ---- the forward ---------------------------------------------------------------------------
    def plan_forward(self, batch: ScheduledBatch) -> ForwardPlan:
        """Start the rooms of first-time rows; choose the batch's layer groups."""
        assert self.pipeline is not None and self._tally is not None and self.kv_wire is not None
        starts, rows, kv_bytes = [], [], 0
        for req, pre, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            r = self._by_rid.get(req.rid)
            if r is None or r.transfer_done:
                continue
            if not r.started:
                draft = req.draft_pages.copy() if req.draft_pages.size else None  # STANDALONE's
                # only the decode sent this request may ask for it
                starts.append(RoomStart(r.room, req.pages.copy(), req.state_slot, _swa(req), draft, r.claim))
                self._start(r)
            # the prompt's last forward: a hybrid model's state of each layer group is final
            # after the group, so it can go with the group's KV
            rows.append(ChunkSend(r.room, pre, pre + n, state=pre + n >= len(req.input_ids), swa_pages=_swa(req)))
            kv_bytes += self.kv_wire.span_nbytes(pre, pre + n, len(req.input_ids))
        choice = self.pipeline.begin(
            batch.num_tokens, sum(c.token_end - c.token_start for c in rows), sum(c.state for c in rows), kv_bytes
        )
        self._piped = tuple(rows) if choice.groups > 1 else ()
        return ForwardPlan(choice.groups, PrefillStep(tuple(starts), self._piped), layer_bounds=choice.bounds)

    def after_forward(self, batch: ScheduledBatch) -> None:
        assert self.pipeline is not None
        self.pipeline.end()
        now = time.monotonic()  # the sender's clock: transfer tails are measured from here
        for i, req in enumerate(batch.reqs):
            r = self._by_rid.get(req.rid)
            if r is not None and batch.completes_prefill(i):
                r.forward_done_at = now

    def after_commit(self, batch: ScheduledBatch) -> None:
        """Every rank ships the finished chunks: full pages of a chunk that is not the last (unless
        its layer groups went already), the rest of the prompt with the first token."""
        piped = {c.room for c in self._piped}
        sends = []
        for i, req in enumerate(batch.reqs):
            r = self._by_rid.get(req.rid)
            if r is None or not r.started or r.transfer_done or req.finished:
                continue
            start, end = batch.prefix_lens[i], batch.prefix_lens[i] + batch.extend_lens[i]
            if batch.completes_prefill(i):
                sends.append(
                    ChunkSend(
                        r.room,
                        start,
                        end,
                        last=True,
                        swa_pages=_swa(req),
                        aux=(req.output_ids[0], req.output_logprobs[0], req.cached_tokens, req.draft_hidden),
                    )
                )
            elif r.room not in piped:
                sends.append(ChunkSend(r.room, start, end, swa_pages=_swa(req)))
        self._piped = ()
        if sends:
            self._post(SendChunks(tuple(sends)))

    # ---- finish and abort ----------------------------------------------------------------------
    def on_finish(self, req: Req, reason: FinishReason, detail: str | int | None) -> bool:
        r = self._by_rid.get(req.rid)
        if r is None:
            return False
        r.engine_done = True
        if reason is FinishReason.ABORT:
            self._fail_room(r, f"prefill failed: {detail}")
        hold = not r.transfer_done
        self._maybe_forget(r)
        return hold

    def abort_transfer(self, req: Req, reason: str) -> None:
        r = self._by_rid.get(req.rid)
        if r is not None:
            self._fail_room(r, f"aborted on the prefill ({reason})")

    def _fail_room(self, r: _Room, reason: str) -> None:
        """Tell the decode the room failed (it may be waiting for it); the pages stay held
        until every rank reported the room drained."""
        if r.transfer_done:
            return
        if not r.started:
            self._start(r)
        self._post(FailRooms(((r.room, reason),)))

    def _start(self, r: _Room) -> None:
        """The room goes to every rank (its page table, or its failure): tally their reports."""
        assert self._tally is not None
        r.started = True
        if self._tally.add(r.room):  # a rank is gone: the room fails at once
            self._abort_everywhere([r.room])

    # ---- transfer news -------------------------------------------------------------------------
    def poll(self) -> list[ConnectorEvent]:
        assert self._workers is not None and self._tally is not None and self.pipeline is not None
        for room in self.refused.take_new():
            r = self._rooms.get(room)
            why = self.refused.pop(room, r.claim) if r is not None and not r.transfer_done else None
            if r is not None and why is not None:
                self._fail_room(r, why)  # answered once every rank reported it (a moment)
        fresh: list[int] = []
        timings = {}
        for rank, news in self._workers.reports():
            if not isinstance(news, RankReport):
                continue
            self._rank_stats[rank] = news.stats
            timings.update({t.room: t for t in news.timings})
            fresh += [room for room, state, reason in news.results if self._tally.report(rank, room, state, reason)]
        for rank, why in self._workers.gone().items():  # a rank that exited can report nothing more
            fresh += self._tally.rank_gone(rank, why)
        if fresh:
            self._abort_everywhere(list(dict.fromkeys(fresh)))
        finished = self._tally.take_finished()
        if not finished:
            return []
        st = self._rank_stats.get(0)
        if st is not None:
            self.pipeline.observe_link(st.busy_bytes, st.busy_s)
        events: list[ConnectorEvent] = []
        for room, state, reason in finished:
            ok = state is TransferState.SUCCESS
            self._succeeded += ok
            self._failed += not ok
            r = self._rooms.get(room)
            if r is None:
                continue
            r.transfer_done = True
            if ok:
                self.pipeline.room_done(timings.get(room), r.forward_done_at)
                record_transfer(r.req.timeline, timings.get(room))
            events.append(TransferFinished(r.req.rid, ok, reason))
            self._maybe_forget(r)
        return events

    def _abort_everywhere(self, rooms: list[int]) -> None:
        """A room failed on one rank: stop it on every rank that is still at it."""
        assert self._tally is not None
        aborts = []
        for room in rooms:
            pending = self._tally.pending_ranks(room)
            why = self._tally.failure(room) or "another TP rank failed"
            if pending:
                logger.warning("room %d failed (%s); aborting it on TP ranks %s", room, why, pending)
                aborts.append((room, why))
        if aborts:
            self._post(AbortRooms(tuple(aborts)))

    def _post(self, cmd: object) -> None:
        assert self._workers is not None
        self._workers.post(cmd)

    def _maybe_forget(self, r: _Room) -> None:
        if not (r.engine_done and r.transfer_done):
            return
        self._rooms.pop(r.room, None)
        self._by_rid.pop(r.req.rid, None)
        self._release_room(r.room)

    def wait_hint(self) -> float | None:
        return TRANSFER_POLL_S if self._rooms else None

    # ---- stats and shutdown --------------------------------------------------------------------
    def sender_stats(self) -> SenderStats:
        """Counters summed over ranks; rooms counted per instance; link busy time and bytes are
        rank 0's (the layer-group planner models one rank's link, like its token_nbytes)."""
        ranks = dict(self._rank_stats)
        worker = self.local_worker
        if worker is not None and worker.sender is not None:  # rank 0's own counters are live, not reported
            ranks[0] = replace(worker.sender.stats)
        out = replace(ranks[0]) if 0 in ranks else SenderStats()
        for name in SUMMED_STATS:
            setattr(out, name, sum(getattr(st, name) for st in ranks.values()))
        out.rooms_succeeded, out.rooms_failed = self._succeeded, self._failed
        return out

    def _transfer_rooms(self) -> int | None:
        """Rank 0's sender book rooms (other ranks' books live in their processes); None without one."""
        worker = self.local_worker
        return worker.sender.num_rooms() if worker is not None and worker.sender is not None else None

    def _unreachable(self) -> str | None:
        """Rank 0's word on its decodes (KVSender.unreachable; every rank pairs with the same decodes)."""
        worker = self.local_worker
        return worker.sender.unreachable() if worker is not None and worker.sender is not None else None

    def stats(self) -> dict[str, Any]:
        if self.pipeline is None or not self.ranks:
            return {}
        st = self.sender_stats()
        pipe = self.pipeline
        return {
            "disaggregation": {
                "mode": "prefill",
                "bootstrap_port": self.bootstrap_port,
                "control_address": self.ranks[0].control_address,
                "data_address": self.ranks[0].data_address,
                "rank_addresses": [r.addresses() for r in self.ranks],  # every rank's (admins only)
                "active_rooms": len(self._rooms),
                "transfer_rooms": self._transfer_rooms(),
                "unreachable": self._unreachable(),  # why no decode can be served (readiness), or None
                "rooms_succeeded": st.rooms_succeeded,
                "rooms_failed": st.rooms_failed,
                "bytes_written": st.bytes_written,
                "ops_submitted": st.ops_submitted,
                "rejected_messages": st.rejected_messages,
                "authenticated": self.cfg.disaggregation.auth_token is not None,
                "auth_rejected": {
                    "control": st.auth_rejected,
                    "bootstrap": self.bootstrap.auth_rejected if self.bootstrap else 0,
                },
                "staging": self.cfg.disaggregation.staging,
                "staged_chunks": st.staged_chunks,
                "staged_bytes": st.staged_bytes,
                "link_busy_s": st.busy_s,
                "link_busy_bytes": st.busy_bytes,
                # frames naming a session or chunk not bound to their sender, and the per-session caps (issue 30)
                "foreign_rejected": st.foreign_rejected,
                "orphans_refused": st.orphans_refused,
                "tombstones_evicted": st.tombstones_evicted,
                "handshakes_refused": self.refused.snapshot(),  # rooms decodes refused, by reason
                "layer_groups": pipe.stats(),
            },
            # the observer's counters: the last batch's choice (bench probes read `num_groups`), the
            # transfer left after the forward summed over rooms (bench probes take deltas)
            **pipe.counters.snapshot(),
        }

    def shutdown(self) -> None:
        if self.bootstrap is not None:
            self.bootstrap.close()
            self.bootstrap = None
