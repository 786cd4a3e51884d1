"""The PD prefill engine: an `Engine` that computes prompts and ships their KV with a `KVSender`.

Per request (DESIGN.md §3), keyed by its bootstrap_room:
- admission: the request runs with max_new_tokens = 1 and the engine holds its pages after the
  finish (`hold_finished_pages`) until the sender says no write from them can still be in flight;
- first prefill batch: right before its forward the whole prompt's pages are allocated (they were
  promised at admission) and the room is added to the sender with that page table;
- layer groups (layer-pipelined transfer, F5): per prefill batch `LayerPipeline` (cost model of
  kvpipe/engine/layer_groups.py, or the fixed --disaggregation-layer-groups N) picks N groups;
  with N > 1, after each group `send(room, start, end, layer_start, layer_end)` for every row
  of the batch, so a group's KV is on the wire while the next group computes (on CUDA the write
  waits on an event recorded after the group). With N = 1 (plain path) nothing is sent per group;
- every finished chunk not sent group by group: `send(room, start, end)`; the sender moves full
  pages only and keeps a trailing partial page for the next call;
- prefill done: `send(room, start, n, last=True, aux=(first token, logprob))`;
- sender reports Success: the finish (with the first token) goes to the client; Failed: an ABORT
  with the reason. Either way the pages are released then, and only then.
A prefill-side failure (rejected prompt, forward error, abort, client gone) fails the room in the
sender (`add_room` with no pages if needed, then `abort`), so the decode hears of it at once.

Threads: `add_request`/`abort` from any thread; everything else runs on the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from kvpipe.config import ServerConfig
from kvpipe.engine.disagg import TRANSFER_POLL_S, data_host, make_backend, register_pool
from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.engine import Engine
from kvpipe.engine.layer_groups import LayerGroupPolicy
from kvpipe.engine.layer_pipeline import LayerPipeline
from kvpipe.engine.request import FinishReason, Req, TokenOutput
from kvpipe.engine.scheduler import SchedulerHooks
from kvpipe.engine.tp_disagg import make_sender
from kvpipe.engine.tp_sender import TPSender
from kvpipe.transfer.backends.base import TransferBackend
from kvpipe.transfer.bootstrap import BootstrapServer
from kvpipe.transfer.layout import KVLayout
from kvpipe.transfer.sender import KVSender
from kvpipe.transfer.state import TransferState

logger = logging.getLogger(__name__)


@dataclass
class _Room:
    """Engine-thread bookkeeping of one request on the prefill."""

    req: Req
    added: bool = False  # sender.add_room was called
    chunk_start: int = 0  # start of the chunk being committed (the last send's token_start)
    result: TokenOutput | None = None  # the engine's finish, held until the transfer succeeds
    replied: bool = False  # the client got its final output already
    engine_done: bool = False  # the engine finished the request (its pages are held)
    transfer_done: bool = False  # the sender reported the room (or it never reached the sender)
    forward_done_at: float | None = None  # time.monotonic() when its last prefill forward ended

    @property
    def room(self) -> int:
        assert self.req.bootstrap_room is not None
        return self.req.bootstrap_room


class PrefillEngine:
    """EngineLike for `--disaggregation-mode prefill` (any TP size)."""

    def __init__(self, cfg: ServerConfig, backend: TransferBackend | None = None) -> None:
        cfg.check_servable()
        d = cfg.disaggregation
        self.cfg = cfg
        hooks = SchedulerHooks(on_chunk_done=self._on_chunk_done, on_prefill_done=self._on_prefill_done)
        self.engine = Engine(cfg, hooks, hold_finished_pages=True, prefill_layer_groups=self._plan_batch,
                             on_group_done=self._on_group_done)
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.context_length = self.engine.context_length
        self.eos_token_ids = self.engine.eos_token_ids
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._claimed: set[int] = set()  # rooms of requests added and not yet released (any thread)
        self._new: list[Req] = []
        self._aborts: list[str] = []
        self._rooms: dict[int, _Room] = {}  # engine thread only
        self._by_rid: dict[str, _Room] = {}
        # rows of the prefill batch being forwarded whose KV goes out group by group:
        # (room, chunk start, chunk end); empty for a plain-path batch
        self._piped: list[tuple[_Room, int, int]] = []
        self.bootstrap: BootstrapServer | None = None
        self.sender: KVSender | TPSender | None = None
        self.backend: TransferBackend | None = None
        try:
            self.layout = KVLayout.from_pool(self.engine.runner.pool, 0, self.model_config.num_kv_heads)
            self.backend = backend if backend is not None else make_backend(cfg)
            register_pool(self.backend, self.layout)
            host = data_host(cfg)
            self.bootstrap = BootstrapServer(cfg.host, d.bootstrap_port).start()
            reg_host = "127.0.0.1" if cfg.host in ("0.0.0.0", "") else "::1" if cfg.host == "::" else cfg.host
            # one KVSender per TP rank (children's behind a TPSender, kvpipe/engine/tp_sender.py)
            self.sender = make_sender(cfg, self.engine, self.layout, self.backend, host,
                                      (reg_host, self.bootstrap.port))
            self.pipeline = LayerPipeline(LayerGroupPolicy.parse(d.layer_groups), self.model_config.num_layers,
                                          self.layout.token_nbytes, self.engine.runner.device)
        except BaseException:
            self._close_transfer(own_backend=backend is None)
            self.engine.shutdown()
            raise
        self._own_backend = backend is None
        logger.info("prefill ready: bootstrap port %d, control %s, data %s", self.bootstrap.port,
                    self.sender.control_address, self.backend.address)

    @property
    def bootstrap_port(self) -> int:
        assert self.bootstrap is not None
        return self.bootstrap.port

    # ---- thread-safe entry points ----------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a prefill request (any thread). ValueError: no bootstrap_room, a room or rid in use."""
        room = req.bootstrap_room
        if room is None:
            raise ValueError("a prefill server needs bootstrap_room (and bootstrap_host/port) with every "
                             "request; send requests through sglang-router --pd-disaggregation")
        req.params = replace(req.params, max_new_tokens=1)  # the decode server generates the rest
        # Under our lock, so the engine thread sees the room before the engine runs the request.
        with self._lock:
            if room in self._claimed:
                raise ValueError(f"bootstrap_room {room} is already in use on this prefill server")
            self.engine.add_request(req)  # raises for a rid in use
            self._claimed.add(room)
            self._new.append(req)
        self._wake.set()

    def abort(self, rid: str) -> None:
        with self._lock:
            self._aborts.append(rid)
        self.engine.abort(rid)
        self._wake.set()

    def has_work(self) -> bool:
        with self._lock:
            if self._new or self._aborts:
                return True
        return bool(self._rooms) or self.engine.has_work()

    def stats(self) -> dict:
        s = self.engine.stats()
        sender = self.sender
        if sender is not None:
            st = sender.stats
            s["disaggregation"] = {
                "mode": "prefill", "bootstrap_port": self.bootstrap_port, "control_address": sender.control_address,
                "data_address": self.backend.address if self.backend else None, "active_rooms": len(self._rooms),
                "rooms_succeeded": st.rooms_succeeded, "rooms_failed": st.rooms_failed,
                "bytes_written": st.bytes_written, "ops_submitted": st.ops_submitted,
                "rejected_messages": st.rejected_messages,
                "link_busy_s": st.busy_s, "link_busy_bytes": st.busy_bytes,
                "layer_groups": self.pipeline.stats(),
            }
            # the layer-group choice of the last prefill batch (bench probes read `num_groups`)
            s["num_groups"] = self.pipeline.last.groups
            # transfer time left after the forward, summed over rooms (bench probes take deltas)
            s["transfer_tail_ms_sum"] = self.pipeline.tail_ms_sum
            s["transfer_tail_count"] = self.pipeline.tail_count
            s["layer_groups_reason"] = self.pipeline.last.reason
            s["layer_group_batches"] = dict(self.pipeline.batches_by_groups)
        return s

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        outs: list[TokenOutput] = []
        self._adopt_new()
        with self._lock:
            aborts, self._aborts = self._aborts, []
        for rid in aborts:
            self._on_abort(rid, outs)
        try:
            eng_outs = self.engine.step()
        except Exception as e:
            # The engine finished the batch's requests with ABORT (no outputs): fail their rooms.
            for r in list(self._rooms.values()):
                if r.req.finished and not r.engine_done:
                    self._engine_finished(r, None, f"forward failed: {e}", outs)
            raise
        for out in eng_outs:
            r = self._room_of(out.rid)
            if r is None or out.finish_reason is None:
                outs.append(out)
            else:
                self._engine_finished(r, out, str(out.finish_detail), outs)
        assert self.sender is not None
        finished = self.sender.poll()
        timings = {}
        if finished:
            st = self.sender.stats
            self.pipeline.observe_link(st.busy_bytes, st.busy_s)
            timings = {t.room: t for t in self.sender.take_timings()}
        for room, state, reason in finished:
            r = self._rooms.get(room)
            if r is None:
                continue
            r.transfer_done = True
            if state is TransferState.SUCCESS:
                self.pipeline.room_done(timings.get(room), r.forward_done_at)
            if state is TransferState.SUCCESS and r.result is not None:
                if not r.replied:
                    outs.append(r.result)
                    r.replied = True
            else:
                self._reply_abort(r, f"KV transfer failed: {reason}", outs)
                if not r.engine_done:
                    self.engine.abort(r.req.rid)  # still prefilling: stop computing for nobody
            self._maybe_release(r)
        if not outs and self._rooms and not self.engine.has_work():
            self._wake.clear()
            self._wake.wait(TRANSFER_POLL_S)  # only transfers in flight: poll without spinning
        return outs

    def _adopt_new(self) -> None:
        with self._lock:
            new, self._new = self._new, []
        for req in new:
            r = self._rooms[req.bootstrap_room] = _Room(req)  # type: ignore[index]
            self._by_rid[req.rid] = r

    def _room_of(self, rid: str) -> _Room | None:
        # a request added after this step adopted the new ones may already run in Engine.step
        r = self._by_rid.get(rid)
        if r is None:
            self._adopt_new()
            r = self._by_rid.get(rid)
        return r

    def _engine_finished(self, r: _Room, out: TokenOutput | None, detail: str, outs: list[TokenOutput]) -> None:
        r.engine_done = True
        if out is not None and out.finish_reason is not FinishReason.ABORT:
            r.result = out  # the prefill is done; the client hears once the KV has landed
        else:
            self._reply_abort(r, detail, outs)
            self._fail_room(r, f"prefill failed: {detail}")
        self._maybe_release(r)

    def _on_abort(self, rid: str, outs: list[TokenOutput]) -> None:
        r = self._room_of(rid)
        if r is None or not r.engine_done:
            return  # the engine's own abort finishes it (and _engine_finished fails the room)
        self._reply_abort(r, "aborted", outs)
        self._fail_room(r, "aborted on the prefill (client disconnected or request aborted)")

    def _reply_abort(self, r: _Room, message: str, outs: list[TokenOutput]) -> None:
        if not r.replied:
            r.replied = True
            outs.append(TokenOutput(r.req.rid, (), (), FinishReason.ABORT, message, len(r.req.input_ids), 0))

    def _fail_room(self, r: _Room, reason: str) -> None:
        """Tell the decode the room failed (it may be waiting for it); pages stay held until the
        sender reports the room drained."""
        if r.transfer_done:
            return
        assert self.sender is not None
        if not r.added:
            try:  # a room with no pages: the sender can answer the decode's request with Failed
                self.sender.add_room(r.room, np.zeros(0, dtype=np.int64))
                r.added = True
            except ValueError as e:  # DuplicateRoomError: the room is someone else's; leave it
                logger.warning("room %d: cannot report the failure to the decode: %s", r.room, e)
                r.transfer_done = True
                return
        self.sender.abort(r.room, reason)

    def _maybe_release(self, r: _Room) -> None:
        if not (r.engine_done and r.transfer_done):
            return
        self.engine.scheduler.release(r.req.rid)  # False when it never held pages
        del self._rooms[r.room]
        del self._by_rid[r.req.rid]
        with self._lock:
            self._claimed.discard(r.room)

    # ---- engine hooks (engine thread, inside Engine.step) -----------------------------------
    def _add_room(self, r: _Room) -> bool:
        """Hand the room's whole page table to the sender (once); False if it cannot be sent."""
        if r.added:
            return True
        assert self.sender is not None
        pages = self.engine.scheduler.allocate_prompt(r.req)
        try:
            self.sender.add_room(r.room, pages.copy())
            r.added = True
            return True
        except ValueError as e:
            logger.warning("room %d: %s", r.room, e)
            r.transfer_done = True  # nothing of ours in the sender
            self.engine.abort(r.req.rid)
            return False

    def _plan_batch(self, batch: ScheduledBatch) -> int:
        """Right before a prefill forward: rooms go to the sender, the layer groups are chosen."""
        rows = []
        for req, pre, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            r = self._room_of(req.rid)
            if r is not None and not r.transfer_done and self._add_room(r):
                rows.append((r, pre, pre + n))
        choice = self.pipeline.begin(batch.num_tokens, sum(t1 - t0 for _, t0, t1 in rows))
        self._piped = rows if choice.groups > 1 else []
        return choice.groups

    def _on_group_done(self, batch: ScheduledBatch, start: int, end: int) -> None:
        """Layers [start, end) of the batch hold their KV: ship them while the next group computes
        (full pages only; the final send() flushes each layer's partial page)."""
        if self._piped:
            assert self.sender is not None
            ready = self.pipeline.group_ready()
            for r, t0, t1 in self._piped:
                if r.transfer_done:
                    continue
                try:
                    self.sender.send(r.room, t0, t1, start, end, ready=ready)
                except (KeyError, ValueError) as e:  # a planning error fails this room, not the batch
                    logger.warning("room %d: %s", r.room, e)
                    self.sender.abort(r.room, f"layer-group send failed: {e}")
        if end == self.model_config.num_layers:
            self.pipeline.end()
            now = time.monotonic()  # the sender's clock: transfer tails are measured from here
            for i, req in enumerate(batch.reqs):
                r = self._by_rid.get(req.rid)
                if r is not None and batch.completes_prefill(i):
                    r.forward_done_at = now

    def _on_chunk_done(self, req: Req, start: int, end: int) -> None:
        r = self._room_of(req.rid)
        if r is None or r.transfer_done or not self._add_room(r):
            return
        assert self.sender is not None
        r.chunk_start = start
        if end < len(req.input_ids) and not any(p is r for p, _, _ in self._piped):
            self.sender.send(r.room, start, end)  # full pages go now; a partial page waits

    def _on_prefill_done(self, req: Req) -> None:
        r = self._room_of(req.rid)
        if r is None or not r.added or r.transfer_done:
            return
        assert self.sender is not None
        n = len(req.input_ids)
        self.sender.send(r.room, r.chunk_start, n, last=True,
                         aux=(req.output_ids[0], req.output_logprobs[0]))

    # ---- shutdown --------------------------------------------------------------------------
    def _close_transfer(self, own_backend: bool) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
        if own_backend and self.backend is not None:
            self.backend.close()

    def shutdown(self) -> None:
        self._close_transfer(self._own_backend)
        self.engine.shutdown()
