"""`DecodeConnector`: the engine's KV connector for `--disaggregation-mode decode` (any TP size).

Per request, keyed by its bootstrap_room (the request flow is in docs/architecture.md):
- claim: bootstrap host and room must be given, the room unused; admit -> REMOTE: the engine
  reserves the prompt's pages (retried while the pool is full, FIFO, until the waiting timeout);
- on_reserved: `KVReceiver.add_room(room, host, port, pages, prefix_len)`: the receiver fetches
  the prefill's bootstrap info, registers every decode rank once per prefill, and asks for the
  KV; with the decode radix cache (--disaggregation-enable-decode-radix-cache) the engine gave
  the request its longest cached prefix, and the prefill sends only the pages past prefix_len
  (a sliding-window model: and the window pages of the prompt's last window the cache lacks,
  below prefix_len too);
- poll: Success with aux data (room echo and vocabulary checked) -> KVArrived (the engine runs
  the finish check on the first token and the request decodes); Failed -> TransferFinished.
  The receiver reports a room only when no write from the prefill can still land in its pages.
- on_finish while the KV is on its way (client abort): the room is aborted, the pages stay
  reserved (True) until the receiver reports it.
TP ranks other than 0 only register their pools (TransferWorker); the receiver on rank 0 speaks
for every decode rank.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpipe.config import ServerConfig
from kvpipe.disagg.commands import StartDecode
from kvpipe.disagg.mtp_transfer import nextn_aux_nbytes
from kvpipe.disagg.pd_connector import PDConnector
from kvpipe.disagg.setup import DECODE_TRANSFER_BACKSTOP_S, data_host, require_auth_off_loopback
from kvpipe.engine.connector import Admission, ConnectorContext, ConnectorEvent, KVArrived, TransferFinished
from kvpipe.engine.request import FinishReason, Req
from kvpipe.engine.window_cache import wanted_window_pages
from kvpipe.model.checkpoint.identity import checkpoint_digest
from kvpipe.transfer.backends.base import TransferBackend
from kvpipe.transfer.control.bootstrap_address import parse_bootstrap_address
from kvpipe.transfer.control.messages import AuxData, DecodeRank, room_claim
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.receiver.kv_receiver import KVReceiver

logger = logging.getLogger(__name__)


class DecodeConnector(PDConnector):
    side = "decode"
    # it never computes a prompt: its prefix cache (--disaggregation-decode-enable-radix-cache)
    # keeps KV only, the prefill sends the KV past the prefix and a hybrid prompt's final state whole
    kv_only_prefix_cache = True

    def __init__(self, cfg: ServerConfig, backend: TransferBackend | None = None) -> None:
        super().__init__(cfg, backend)
        self.prefix_cache = cfg.disaggregation.decode_radix_cache
        self._transfers: dict[int, Req] = {}  # engine thread: room -> request whose KV is on its way
        # engine thread: rooms whose KV was asked for (add_room) and whose request has not finished;
        # an aborted request outside it never asked, and the prefill is told (abort_unrequested)
        self._asked: set[int] = set()
        self._vocab_size = 0
        self.receiver: KVReceiver | None = None

    def start(self, ctx: ConnectorContext) -> None:
        d = self.cfg.disaggregation
        self._vocab_size = ctx.model_config.vocab_size
        require_auth_off_loopback(self.cfg)
        self._attach_draft(ctx)
        self._start_ranks(ctx.workers, StartDecode())
        # what every prefill must agree with, computed once, at load (control/handshake.py)
        handshake = (
            None if self.local_worker is None else self.local_worker.handshake(checkpoint_digest(self.cfg.model_path))
        )
        self.receiver = KVReceiver(
            d,
            ranks=[DecodeRank(r.layout, r.data_address, r.staging, r.state, r.draft) for r in self.ranks],
            model_name=self.cfg.model_name,
            host=data_host(self.cfg),
            on_news=ctx.wake,
            handshake=handshake,
            max_aux_bytes=nextn_aux_nbytes(self.cfg, ctx),  # NEXTN's hidden row (disagg/mtp_transfer.py)
            # --disaggregation-kv-integrity: rank 0 checks the KV it got (transfer/kv_digest.py)
            digester=self.local_worker.kv_digester() if self.local_worker is not None else None,
        ).start()
        logger.info("decode ready: control %s, data %s", self.receiver.control_address, self.ranks[0].data_address)

    # ---- admission -----------------------------------------------------------------------------
    def claim(self, req: Req) -> None:
        if req.bootstrap_room is None or not req.bootstrap_host:
            raise ValueError(
                "a decode server needs bootstrap_host and bootstrap_room (and bootstrap_port) "
                "with every request; send requests through sglang-router --pd-disaggregation"
            )
        # refused at once (400) when the address is malformed (an IP literal or a host name, a port
        # 1..65535: nothing else reaches a URL) or where this decode may not fetch (allow list,
        # loopback only without a token, an address that failed a moment ago), before the request
        # waits for pages and before anything connects anywhere
        addr = parse_bootstrap_address(req.bootstrap_host, req.bootstrap_port)
        if self.receiver is not None:
            why = self.receiver.guard.refusal(addr)
            if why is not None:
                raise ValueError(why)
        self._claim_room(req.bootstrap_room)

    def admit(self, req: Req) -> Admission:
        return Admission.REMOTE

    def reserve_deadline_s(self) -> float:
        return self.cfg.disaggregation.waiting_timeout_s

    def on_reserved(self, req: Req) -> None:
        assert self.receiver is not None and req.bootstrap_room is not None and req.bootstrap_host is not None
        # every TP rank holds the same page ids (one scheduler): the same list per rank, each rank
        # holding its own heads of the cached prefix; the prefill sends the pages past it only
        shared = req.num_shared_pages
        pages = req.pages[shared:].copy()
        # sliding-window models: the pages of the prompt's last window the cache lacks (-1 elsewhere),
        # aligned with pages at its end; with a cached prefix it may start below it (window_cache.py)
        swa = None if req.swa_pages.size == 0 else [wanted_window_pages(req)] * self.receiver.tp_size
        self.receiver.add_room(
            req.bootstrap_room,
            req.bootstrap_host,
            req.bootstrap_port,
            [pages] * self.receiver.tp_size,
            shared * self.cfg.cache.page_size,  # ValueError: nothing was asked for
            state_slot=req.state_slot,  # hybrid models: the prefill fills it too
            swa_pages=swa,
            # STANDALONE: the draft model's pages for the whole prompt (none reserved: none asked for)
            draft_pages=req.draft_pages.copy() if req.draft_pages.size else None,
            claim=room_claim(req.bootstrap_room, req.input_ids),  # this decode was sent the request
        )
        self._transfers[req.bootstrap_room] = req
        self._asked.add(req.bootstrap_room)

    # ---- finish and transfer news --------------------------------------------------------------
    def on_finish(self, req: Req, reason: FinishReason, detail: str | int | None) -> bool:
        room = req.bootstrap_room
        if room is not None and self._transfers.get(room) is req:  # its KV may still be landing
            assert self.receiver is not None
            self.receiver.abort(room, "aborted on the decode (client disconnected or request aborted)")
            return True
        asked = room in self._asked
        self._asked.discard(room)
        if (
            room is not None
            and not asked
            and reason is FinishReason.ABORT
            and req.bootstrap_host
            and self.receiver is not None
        ):
            # it never got pages here: the prefill may hold its KV, waiting for a request
            self.receiver.abort_unrequested(
                room,
                req.bootstrap_host,
                req.bootstrap_port,
                f"aborted on the decode before its KV was requested: {detail}",
                room_claim(room, req.input_ids),
            )
        self._release_room(room)
        return False

    def poll(self) -> list[ConnectorEvent]:
        assert self.receiver is not None
        events: list[ConnectorEvent] = []
        for room, state, reason, aux in self.receiver.poll():
            req = self._transfers.pop(room, None)
            if req is None:
                continue
            self._release_room(room)
            if req.finished:  # aborted while the KV was on its way: its pages are safe now
                self._asked.discard(room)
                events.append(TransferFinished(req.rid, state is TransferState.SUCCESS, reason))
                continue
            if state is TransferState.SUCCESS:
                why = self._check_aux(room, aux)
                if why is None:
                    assert aux is not None
                    events.append(
                        KVArrived(
                            req.rid,
                            aux.first_token_id,
                            aux.first_token_logprob,
                            aux.cached_tokens,
                            draft_tokens=aux.draft_tokens,
                            draft_hidden=aux.hidden,
                        )
                    )
                    continue
                reason = why
            events.append(TransferFinished(req.rid, False, reason))
        return events

    def _check_aux(self, room: int, aux: AuxData | None) -> str | None:
        if aux is None or aux.room != room:
            return f"stale transfer: aux data of room {aux.room if aux else None} arrived for room {room}"
        if not 0 <= aux.first_token_id < self._vocab_size:
            return f"first token id {aux.first_token_id} from the prefill is outside the vocabulary"
        return None

    def wait_hint(self) -> float | None:
        return DECODE_TRANSFER_BACKSTOP_S if self._transfers else None

    def stats(self) -> dict[str, Any]:
        if self.receiver is None:
            return {}
        st = self.receiver.stats
        return {
            "disaggregation": {
                "mode": "decode",
                "control_address": self.receiver.control_address,
                "data_address": self.ranks[0].data_address if self.ranks else None,
                # every rank's (admins only); rank 0's receiver is the decode's control endpoint
                "rank_addresses": [
                    {**r.addresses(), **({"control": self.receiver.control_address} if r.rank == 0 else {})}
                    for r in self.ranks
                ],
                "active_rooms": len(self._transfers),
                "transfer_rooms": self.receiver.num_rooms(),
                "unreachable": self.receiver.unreachable(),  # why no prefill can be served with (readiness), or None
                "rooms_succeeded": st.rooms_succeeded,
                "rooms_failed": st.rooms_failed,
                "rejected_messages": st.rejected_messages,
                "authenticated": self.cfg.disaggregation.auth_token is not None,
                "auth_rejected": {"control": st.auth_rejected + self._staging_auth_rejected()},
                "bootstrap_fetches": st.bootstrap_fetches,
                "foreign_rejected": st.foreign_rejected,  # statuses / aborts not from the room's pairs (issue 30)
                "handshakes_refused": st.handshakes_refused,  # rooms failed: a prefill's handshake refused, by reason
                "kv_integrity": self.cfg.disaggregation.kv_integrity,
                "integrity_failed": st.integrity_failed,  # rooms whose KV differed from the prefill's digest
                **self._staging_stats(),
            }
        }

    def _staging_auth_rejected(self) -> int:
        agent = self.local_worker.staging_agent if self.local_worker is not None else None
        return 0 if agent is None else agent.stats.auth_rejected

    def _staging_stats(self) -> dict[str, Any]:
        """Rank 0's staging ring (every rank runs its own; rank 0's is the one in this process)."""
        agent = self.local_worker.staging_agent if self.local_worker is not None else None
        if agent is None:
            return {"staging": "off"}
        live, used, waiting = agent.usage()
        return {
            "staging": self.cfg.disaggregation.staging,
            "staging_ring": {**vars(agent.stats), "live_slots": live, "used_bytes": used, "waiting": waiting},
            "staging_waits": agent.waits(),  # kvpipe_staging_wait_seconds (server/metrics.py)
        }

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
