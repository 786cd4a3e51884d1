"""The PD decode engine: an `Engine` whose requests get their prompt KV from a prefill server.

Per request (DESIGN.md §3), keyed by its bootstrap_room:
- reserve: `scheduler.reserve` allocates the prompt's pages and promises the rest (retried every
  step while the pool is full, FIFO, until the waiting timeout);
- `receiver.add_room(room, host, port, pages)`: the receiver fetches the prefill's bootstrap
  info, registers once per prefill, and asks for the KV; polled every step;
- Success: the aux data (room echo checked) gives the first token and its logprob; the finish
  check runs on it (EOS, stop ids/strings, max_new_tokens == 1), then the request either finishes
  or enters decode (`add_prefilled`); the first token goes out as a normal TokenOutput;
- Failed: ABORT with the reason. Pages are freed only once the receiver reports the room, i.e.
  when no write from the prefill can still land in them.
A client abort during the transfer answers the client at once and aborts the room; the pages
stay reserved until the receiver says they are safe.

Threads: `add_request`/`abort` from any thread; everything else runs on the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvpipe.config import ServerConfig
from kvpipe.engine.disagg import TRANSFER_POLL_S, data_host, make_backend, register_pool
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, TokenOutput
from kvpipe.engine.tp_disagg import decode_ranks
from kvpipe.transfer.backends.base import TransferBackend
from kvpipe.transfer.layout import KVLayout
from kvpipe.transfer.messages import AuxData
from kvpipe.transfer.receiver import KVReceiver
from kvpipe.transfer.state import TransferState

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    req: Req
    deadline: float  # give up waiting for free pages at this time (monotonic)


class DecodeEngine:
    """EngineLike for `--disaggregation-mode decode` (any TP size)."""

    def __init__(self, cfg: ServerConfig, backend: TransferBackend | None = None) -> None:
        cfg.check_servable()
        self.cfg = cfg
        self.engine = Engine(cfg)
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.context_length = self.engine.context_length
        self.eos_token_ids = self.engine.eos_token_ids
        self._waiting_timeout_s = cfg.disaggregation.waiting_timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._claimed: set[int] = set()  # rooms of requests added and not yet out of the transfer phase
        self._active: set[str] = set()  # rids added whose pages (if any) are not freed yet
        self._inbox: list[Req] = []
        self._aborts: list[str] = []
        self._pending: deque[_Pending] = deque()  # engine thread only: waiting for pages
        self._transfers: dict[int, Req] = {}  # room -> request whose KV is on its way
        self._aborted: set[int] = set()  # rooms whose client already got its ABORT
        self.backend: TransferBackend | None = None
        self.receiver: KVReceiver | None = None
        own = backend is None
        try:
            self.layout = KVLayout.from_pool(self.engine.runner.pool, 0, self.model_config.num_kv_heads)
            self.backend = backend if backend is not None else make_backend(cfg)
            register_pool(self.backend, self.layout)
            # one destination per TP rank: rank 0's pool here, the children's through their agents
            ranks = decode_ranks(cfg, self.engine, self.layout, self.backend)
            self.receiver = KVReceiver(cfg.disaggregation, ranks=ranks,
                                       model_name=cfg.model_name, host=data_host(cfg)).start()
        except BaseException:
            if own and self.backend is not None:
                self.backend.close()
            self.engine.shutdown()
            raise
        self._own_backend = own
        logger.info("decode ready: control %s, data %s", self.receiver.control_address, self.backend.address)

    # ---- thread-safe entry points ----------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request whose prompt KV a prefill server computes (any thread). ValueError:
        no bootstrap info, or its rid / bootstrap_room is in use."""
        if req.bootstrap_room is None or not req.bootstrap_host:
            raise ValueError("a decode server needs bootstrap_host and bootstrap_room (and bootstrap_port) "
                             "with every request; send requests through sglang-router --pd-disaggregation")
        with self._lock:
            if req.rid in self._active:
                raise ValueError(f"a request with rid {req.rid!r} is already running")
            if req.bootstrap_room in self._claimed:
                raise ValueError(f"bootstrap_room {req.bootstrap_room} is already in use on this decode server")
            self._active.add(req.rid)
            self._claimed.add(req.bootstrap_room)
            self._inbox.append(req)
        self._wake.set()

    def abort(self, rid: str) -> None:
        with self._lock:
            self._aborts.append(rid)
        self._wake.set()

    def has_work(self) -> bool:
        with self._lock:
            if self._inbox or self._aborts:
                return True
        return bool(self._pending or self._transfers) or self.engine.has_work()

    def stats(self) -> dict:
        s = self.engine.stats()
        s["num_waiting"] += len(self._pending)
        if self.receiver is not None:
            st = self.receiver.stats
            s["disaggregation"] = {
                "mode": "decode", "control_address": self.receiver.control_address,
                "data_address": self.backend.address if self.backend else None,
                "active_rooms": len(self._transfers), "rooms_succeeded": st.rooms_succeeded,
                "rooms_failed": st.rooms_failed, "rejected_messages": st.rejected_messages,
                "bootstrap_fetches": st.bootstrap_fetches,
            }
        return s

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        outs: list[TokenOutput] = []
        with self._lock:
            new, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        now = time.monotonic()
        for req in new:
            if not req.eos_token_ids:
                req.eos_token_ids = self.eos_token_ids
            self._pending.append(_Pending(req, now + self._waiting_timeout_s))
        for rid in aborts:
            self._on_abort(rid, outs)
        self._reserve(now, outs)
        self._poll(outs)
        try:
            eng_outs = self.engine.step()
        except Exception:
            self._prune_active()  # the engine finished the failed batch's requests without outputs
            raise
        for out in eng_outs:
            if out.finish_reason is not None:
                self._forget(out.rid)
            outs.append(out)
        if not outs and (self._transfers or self._pending) and not self.engine.has_work():
            self._wake.clear()
            self._wake.wait(TRANSFER_POLL_S)  # only transfers in flight: poll without spinning
        return outs

    def _reserve(self, now: float, outs: list[TokenOutput]) -> None:
        """Give waiting requests their prompt pages (FIFO) and ask their prefill for the KV."""
        assert self.receiver is not None
        sched = self.engine.scheduler
        while self._pending:
            p = self._pending[0]
            req = p.req
            if not sched.reserve(req):
                if not req.finished and now < p.deadline:
                    return  # no room now: retry next step (head of line)
                self._pending.popleft()
                if not req.finished:  # reserve() registered it as live: finish it there too
                    sched.finish(req, FinishReason.ABORT, f"no free KV pages within the waiting timeout "
                                                          f"({self._waiting_timeout_s}s)")
                self._end(req, outs)
                continue
            self._pending.popleft()
            room = req.bootstrap_room
            assert room is not None and req.bootstrap_host is not None
            try:
                # every TP rank holds the same page ids (one scheduler): the same list per rank
                pages = req.pages.copy()
                self.receiver.add_room(room, req.bootstrap_host, req.bootstrap_port,
                                       [pages] * self.receiver.tp_size, 0)
            except ValueError as e:  # a duplicate room, or pages the receiver refuses: nothing was sent
                sched.finish(req, FinishReason.ABORT, str(e))
                self._end(req, outs)
                continue
            self._transfers[room] = req

    def _poll(self, outs: list[TokenOutput]) -> None:
        assert self.receiver is not None
        sched = self.engine.scheduler
        for room, state, reason, aux in self.receiver.poll():
            req = self._transfers.pop(room, None)
            if req is None:
                continue
            if room in self._aborted:  # the client was told already; the pages are safe now
                self._aborted.discard(room)
                sched.finish(req, FinishReason.ABORT, "aborted")
                self._release(req)
                continue
            if state is TransferState.SUCCESS:
                why = self._check_aux(room, aux)
                if why is None:
                    assert aux is not None
                    self._first_token(req, aux, outs)
                    continue
                reason = why
            sched.finish(req, FinishReason.ABORT, f"KV transfer failed: {reason}")
            self._end(req, outs)

    def _check_aux(self, room: int, aux: AuxData | None) -> str | None:
        if aux is None or aux.room != room:
            return f"stale transfer: aux data of room {aux.room if aux else None} arrived for room {room}"
        if not 0 <= aux.first_token_id < self.model_config.vocab_size:
            return f"first token id {aux.first_token_id} from the prefill is outside the vocabulary"
        return None

    def _first_token(self, req: Req, aux: AuxData, outs: list[TokenOutput]) -> None:
        req.output_ids.append(aux.first_token_id)
        req.output_logprobs.append(aux.first_token_logprob)
        fin = self.engine.finisher.check(req, 1)
        if fin is not None:
            self.engine.scheduler.finish(req, *fin)  # frees its pages: the transfer is over
            self.engine.finisher.forget(req.rid)
        else:
            self.engine.scheduler.add_prefilled(req)
            with self._lock:
                self._claimed.discard(req.bootstrap_room)  # type: ignore[arg-type]
        outs.append(TokenOutput(req.rid, (aux.first_token_id,), (aux.first_token_logprob,), req.finish_reason,
                                req.finish_detail, len(req.input_ids), 0))
        if fin is not None:
            self._release(req)

    def _on_abort(self, rid: str, outs: list[TokenOutput]) -> None:
        for i, p in enumerate(self._pending):
            if p.req.rid == rid:
                del self._pending[i]
                if not p.req.finished:
                    self.engine.scheduler.finish(p.req, FinishReason.ABORT, "aborted")
                self._end(p.req, outs)
                return
        for room, req in self._transfers.items():
            if req.rid == rid:
                if room not in self._aborted:
                    assert self.receiver is not None
                    self.receiver.abort(room, "aborted on the decode (client disconnected or request aborted)")
                    self._aborted.add(room)
                    outs.append(TokenOutput(rid, (), (), FinishReason.ABORT, "aborted", len(req.input_ids), 0))
                return
        self.engine.abort(rid)  # decoding (or unknown): the engine finishes it

    def _end(self, req: Req, outs: list[TokenOutput]) -> None:
        """A request finished before decoding (its pages are free already): tell the client."""
        outs.append(TokenOutput(req.rid, (), (), req.finish_reason, req.finish_detail, len(req.input_ids), 0))
        self._release(req)

    def _release(self, req: Req) -> None:
        with self._lock:
            self._claimed.discard(req.bootstrap_room)  # type: ignore[arg-type]
            self._active.discard(req.rid)

    def _prune_active(self) -> None:
        waiting = {p.req.rid for p in self._pending} | {r.rid for r in self._transfers.values()}
        with self._lock:
            new = {r.rid for r in self._inbox}
            self._active = {rid for rid in self._active if rid in waiting or rid in new
                            or self.engine.scheduler.get(rid) is not None}

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._active.discard(rid)

    # ---- shutdown --------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self._own_backend and self.backend is not None:
            self.backend.close()
        self.engine.shutdown()
