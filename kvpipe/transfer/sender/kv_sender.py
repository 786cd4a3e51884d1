"""Prefill side of KV transfer: one `KVSender` per prefill TP rank. Thread-safe, engine-agnostic.

    sender = KVSender(cfg, layout=KVLayout.from_pool(pool, head_start, total_kv_heads),
                      backend=backend, tp_rank=r, tp_size=tp, model_name=name, instance_id=iid)
    sender.start(bootstrap=("127.0.0.1", 8998))   # control endpoint + worker, registers the rank
    sender.add_room(room, src_pages)              # request admitted; src_pages: its page table
                                                  # (+ src_swa_pages: window table, swa layouts;
                                                  # + src_draft_pages: the draft model's pages)
    sender.send(room, t0, t1, layer_start, layer_end)          # KV of tokens < t1 ready (chunk,
    sender.send(room, t0, n, last=True, aux=(token_id, logprob))  # layer group); final call
    sender.pump()                                 # optional: submit what is queued now, here
    for room, state, reason in sender.poll(): ...  # Success or Failed: free the room's pages now
    sender.take_timings()                         # bytes and busy seconds of rooms that succeeded
    sender.abort(room, "client went away")        # the room turns Failed; poll reports it later
    sender.close()

The caller registers the pool's buffers with `backend` beforehand. `instance_id` must be shared
by all ranks of one prefill instance and change on every restart.

What happens inside: a receive thread (control/endpoint.py) hands RegisterPeer (a decode rank's layout and
addresses, validated once per session), TransferRequest (room -> dst pages, prefix_len; validated;
kept until add_room if it comes first), Abort and Heartbeat to the `SenderBook` (book.py,
all decisions, no I/O). A worker thread plans queued send() calls, submits write batches within
`max_inflight_ops` (`pump()` runs one such pass on the caller's thread), polls them, enforces
deadlines and declares silent decodes dead (a gap in its own passes is not the decodes' silence:
lifecycle.PeerLiveness.observed); heartbeats leave from their own thread (control/pulse.py).
After the last batch landed every destination gets TransferStatus(SUCCESS, aux); a failed room
first drains its in-flight writes, then gets TransferStatus(FAILED): prefill's final word, after
which nothing it sent can still land. poll() reports a room only once it is drained, so freeing
its pages is safe. Backend calls run outside the lock (a local submit copies inline).

Session id of this rank on the wire: f"{instance_id}/{tp_rank}" (the decode derives it from the
bootstrap info to match heartbeats).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.backends.base import BatchHandle, BatchState, TransferBackend, TransferError
from kvpipe.transfer.control.auth import Authenticator, authenticator
from kvpipe.transfer.control.bootstrap import BootstrapError, PrefillRankInfo, register_prefill_rank
from kvpipe.transfer.control.endpoint import ControlEndpoint
from kvpipe.transfer.control.handshake import Handshake
from kvpipe.transfer.control.messages import SENDER_RECEIVES, AuxTuple, limits_for
from kvpipe.transfer.control.pulse import Pulse
from kvpipe.transfer.kv_digest import KVDigester
from kvpipe.transfer.lifecycle import Clock, TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.window_table import window_pages_problem
from kvpipe.transfer.recurrent.layout import StateLayout
from kvpipe.transfer.sender.book import SenderBook
from kvpipe.transfer.sender.plan_types import OpBatch, SendCall, StagedChunk, StagingPolicy
from kvpipe.transfer.sender.stats import SenderStats, TransferTiming
from kvpipe.transfer.staging.buffers import StagingBuffer

log = logging.getLogger(__name__)


def _max_control_ints(layout: KVLayout, state_layout: StateLayout | None, draft_layout: KVLayout | None) -> int:
    """The longest int list a decode can send: a page list (a prompt fits this rank's pool), or
    buffer addresses / layer indices of a compatible layout."""
    return max(
        layout.num_pages,
        layout.num_buffers,
        state_layout.num_model_layers if state_layout else 0,
        max(draft_layout.num_pages, draft_layout.num_buffers) if draft_layout else 0,
    )


class KVSender:
    def __init__(
        self,
        cfg: DisaggregationConfig,
        *,
        layout: KVLayout,
        backend: TransferBackend,
        tp_rank: int = 0,
        tp_size: int = 1,
        model_name: str,
        instance_id: str | None = None,
        host: str = "127.0.0.1",
        clock: Clock = time.monotonic,
        staging: StagingBuffer | None = None,
        state_layout: StateLayout | None = None,
        on_news: Callable[[], None] | None = None,
        handshake: Handshake | None = None,
        draft_layout: KVLayout | None = None,
        draft_at_prefix: bool = False,
        draft_rank: int | None = None,
        digester: KVDigester | None = None,
    ) -> None:
        """`staging`: a registered local staging buffer over this rank's KV (staging/buffers.py); with
        cfg.staging "on" or "auto" sends to decode ranks that offer a staging ring are staged.
        `state_layout`: this rank's registered recurrent-state pool (hybrid models): layer ranges
        of send() are then model layers, and every room names its state slot in add_room.
        `on_news` (called on the worker's or pump()'s thread once a room is ready for poll()): e.g.
        wake the engine loop, whose answer for the room waits for it, instead of its poll timer.
        `handshake`: the instance's (control/handshake.py), registered with the bootstrap server for
        decodes to compare with theirs (None: not checked; tests and benchmarks of bare senders).
        `draft_layout`: this rank's registered draft-model pool (STANDALONE speculative decoding,
        NEXTN's MTP layer): its layers are send() layers num_layers .. num_layers + draft layers - 1
        (num_layers: the model's layers with a state layout), after the target's (the last layer
        group), and rooms name their draft pages in add_room.
        `draft_at_prefix`: SenderBook's (NEXTN: the MTP KV is sent from the decode's prefix on).
        `draft_rank`: SenderBook's (NEXTN: the MTP KV lives on TP rank 0 of each side only).
        `digester`: over this rank's pool, for decodes that check the KV they got (kv_digest.py)."""
        if instance_id is None:
            if tp_size != 1:
                raise ValueError("with tp_size > 1 every rank needs the same instance_id")
            instance_id = uuid.uuid4().hex[:12]
        self.cfg, self.layout, self.backend = cfg, layout, backend
        self.state_layout = state_layout
        self.draft_layout = draft_layout
        if state_layout is not None and len(state_layout.kv_layers) != layout.num_layers:
            raise ValueError(
                f"state layout names {len(state_layout.kv_layers)} full-attention layers, "
                f"the KV layout has {layout.num_layers}"
            )
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model_name, self.instance_id = model_name, instance_id
        self.handshake = handshake  # published with the registration: what decodes must agree with
        self.session_id = f"{instance_id}/{tp_rank}"
        self._on_news = on_news
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # one worker pass at a time: the worker thread's, or pump()'s on the engine's thread
        self._pass_lock = threading.Lock()
        self._progress_at = clock()  # (under _pass_lock) when a pass last submitted or finished a batch
        self._backend_progress: dict[str, float] = {}  # (under _pass_lock) backend.last_progress seen, per peer
        self._auth = authenticator(cfg.auth_token)  # control frames and the bootstrap registration
        max_ints = _max_control_ints(layout, state_layout, draft_layout)
        self._endpoint = ControlEndpoint(
            host,
            self._on_message,
            name=f"kvsender-{tp_rank}",
            send_hwm=cfg.tuning.control_send_hwm,
            auth=self._auth,
            limits=limits_for(SENDER_RECEIVES, max_ints),
            max_sockets=cfg.limits.max_reply_sockets,
            ports=cfg.control_ports,
        )
        self._stager = staging if cfg.staging != "off" else None
        policy = (
            None if self._stager is None else StagingPolicy(cfg.staging, self._stager.nbytes // 4, self._stager.nbytes)
        )
        self._book = SenderBook(
            cfg,
            layout,
            tp_rank,
            tp_size,
            self.session_id,
            self._endpoint.send,
            control_address=self._endpoint.address,
            staging=policy,
            staging_addr=0 if self._stager is None else self._stager.addr,
            state_layout=state_layout,
            own_data_address=backend.address,
            draft_layout=draft_layout,
            draft_at_prefix=draft_at_prefix,
            draft_rank=draft_rank,
            digest=None if digester is None else digester.digest,
            reconnect=self._endpoint.disconnect,
        )
        self._worker = threading.Thread(target=self._run, name=f"kvsender-{tp_rank}-worker", daemon=True)
        self._pulse = Pulse(cfg.heartbeat_interval_s, self._beat, f"kvsender-{tp_rank}", clock)

    @property
    def stats(self) -> SenderStats:
        return replace(self._book.stats, auth_rejected=self._endpoint.stats.auth_rejected)

    @property
    def control_address(self) -> str:
        return self._endpoint.address

    def num_rooms(self) -> int:
        """Rooms the book still holds (finished ones leave it): 0 once idle, else a leak."""
        with self._lock:
            return len(self._book.rooms)

    def is_bound(self, room: int) -> bool:
        """A decode session asked for `room` here (its TransferRequest was accepted)."""
        with self._lock:
            r = self._book.rooms.get(room)
            return r is not None and bool(r.dests)

    @property
    def info(self) -> PrefillRankInfo:
        return PrefillRankInfo(
            self.tp_rank,
            self.tp_size,
            self.layout,
            self.backend.address,
            self.control_address,
            self.model_name,
            self.instance_id,
            self.handshake,
        )

    def start(self, bootstrap: tuple[str, int] | None = None, registrar_key: bytes | None = None) -> KVSender:
        """Start the threads; with `bootstrap` (host, port), register this rank there, signed with
        `registrar_key` (the prefill instance's own secret: bootstrap.py) or else the shared token."""
        self._endpoint.start()
        self._worker.start()
        self._pulse.start()
        registrar = self._auth if registrar_key is None else Authenticator(registrar_key)
        if bootstrap is not None:
            end = time.monotonic() + self.cfg.bootstrap_timeout_s
            while True:  # the bootstrap server may still be starting
                try:
                    register_prefill_rank(*bootstrap, self.info, self.cfg.tuning.http_timeout_s, registrar)
                    break
                except BootstrapError:
                    if time.monotonic() >= end:
                        self.close()
                        raise
                    time.sleep(0.05)
        return self

    def close(self) -> None:
        """Stop the threads. In-flight writes are not waited for; the backend stays open."""
        self._stop.set()
        self._wake.set()
        self._pulse.close()
        if self._worker.is_alive():
            self._worker.join(timeout=5.0)
        self._endpoint.close()

    # ---- engine API ------------------------------------------------------------------------

    def add_room(
        self,
        room: int,
        src_pages: np.ndarray | list[int],
        state_slot: int | None = None,
        src_swa_pages: np.ndarray | list[int] | None = None,
        src_draft_pages: np.ndarray | list[int] | None = None,
        claim: bytes | None = None,
    ) -> None:
        """The engine admitted request `room`; `src_pages` is its page table (tokens from 0);
        `state_slot`: its recurrent-state slot (hybrid models: required; it must stay the room's
        until poll() reported the room); `src_swa_pages`: its window page table (a layout with
        swa_layers: aligned with src_pages, -1 where no sliding-window page is held, shorter
        while not allocated; None: none yet). The pages the decode asks for must stay the room's
        until poll() reported it. `src_draft_pages`: the room's draft-model pages (a sender with a
        draft layout), the whole prompt's from token 0, kept like `src_pages`; None: no draft KV
        for this room. `claim`: messages.room_claim(room, prompt): only a decode that names it may
        ask for the room (None: the first to ask). Raises DuplicateRoomError if the room is active already
        (reject that request only), ValueError for pages or a slot outside the pools."""
        pages = self._check_pages(room, src_pages)
        draft = self._check_draft_pages(room, src_draft_pages)
        sl = self.state_layout
        if sl is not None and pages.size and (state_slot is None or not 0 <= state_slot < sl.num_slots):
            raise ValueError(f"room {room}: state slot {state_slot} outside [0, {sl.num_slots})")
        swa = self._check_swa_pages(room, src_swa_pages, pages)
        with self._lock:
            self._book.add_room(room, pages, self._clock(), None if sl is None else state_slot, swa, draft, claim)
        self._wake.set()

    def _check_draft_pages(self, room: int, draft_pages: np.ndarray | list[int] | None) -> np.ndarray | None:
        if draft_pages is None:
            return None
        if self.draft_layout is None:
            raise ValueError(f"room {room}: draft pages for a sender without a draft-model pool")
        pages = np.asarray(draft_pages, dtype=np.int64).ravel()
        if pages.size and (pages.min() < 0 or pages.max() >= self.draft_layout.num_pages):
            raise ValueError(f"room {room}: draft pages outside [0, {self.draft_layout.num_pages})")
        return pages

    def _check_swa_pages(
        self, room: int, swa_pages: np.ndarray | list[int] | None, pages: np.ndarray
    ) -> np.ndarray | None:
        if swa_pages is None:
            return None
        if not self.layout.swa_layers:
            raise ValueError(f"room {room}: sliding-window pages for a layout without sliding-window layers")
        swa = np.asarray(swa_pages, dtype=np.int64).ravel()
        why = window_pages_problem(swa, self.layout.num_pages, pages, exact=False, aliased=self.layout.aliased)
        if why is not None:
            raise ValueError(f"room {room}: {why}")
        return swa

    def _check_pages(self, room: int, src_pages: np.ndarray | list[int]) -> np.ndarray:
        pages = np.asarray(src_pages, dtype=np.int64).ravel()
        if pages.size and (pages.min() < 0 or pages.max() >= self.layout.num_pages):
            raise ValueError(f"room {room}: source pages outside [0, {self.layout.num_pages})")
        return pages

    def send(
        self,
        room: int,
        token_start: int,
        token_end: int,
        layer_start: int = 0,
        layer_end: int | None = None,
        last: bool = False,
        aux: AuxTuple | None = None,
        src_pages: np.ndarray | list[int] | None = None,
        ready: Callable[[], bool] | None = None,
        state: bool = False,
        src_swa_pages: np.ndarray | list[int] | None = None,
    ) -> bool:
        """KV of tokens [token_start, token_end), and of every token before, is ready in layers
        [layer_start, layer_end) (model layers). `last=True` (once, with aux: AuxTuple) means
        the prompt is complete in every layer, and so is the recurrent state of a hybrid model:
        it is written before the final status. `state=True`: this call comes from the prompt's
        last forward, so the state of the linear layers in [layer_start, layer_end) is final
        and goes now (layer-pipelined prefill). `src_pages`: the room's page table when it grew
        since add_room (it must extend the old one). `src_swa_pages`: a newer snapshot of the
        room's window page table (it need not extend the old one: pages may have slid out, -1).
        `ready`: the KV is still being computed
        on a device; nothing of this call (or later ones of the room) is written before
        `ready()` returns True (e.g. a CUDA event's `query`). Returns False if the room already failed."""
        if last and aux is None:
            raise ValueError(f"room {room}: the last send() carries aux = (first token id, logprob)")
        call = self._call(token_start, token_end, layer_start, layer_end, last, ready, state)
        pages = None if src_pages is None else self._check_pages(room, src_pages)
        swa = None
        if src_swa_pages is not None:
            if not self.layout.swa_layers:
                raise ValueError(f"room {room}: sliding-window pages for a layout without sliding-window layers")
            swa = np.asarray(src_swa_pages, dtype=np.int64).ravel()  # checked by the book against src_pages
        with self._lock:
            ok = self._book.add_call(room, call, aux, pages, swa)
        self._wake.set()
        return ok

    def _call(
        self,
        token_start: int,
        token_end: int,
        layer_start: int,
        layer_end: int | None,
        last: bool,
        ready: Callable[[], bool] | None,
        state: bool,
    ) -> SendCall:
        """Model layers -> KV buffers (a hybrid pool has them for full-attention layers only) and
        the linear layers whose state goes with the call. Layers past the target's are the draft
        model's (NEXTN's MTP layer next to a hybrid target): draft layer i is send layer
        num_layers + i, after the target's KV buffers."""
        sl = self.state_layout
        n_draft = 0 if self.draft_layout is None else self.draft_layout.num_layers
        if sl is None:
            end = self.layout.num_layers + n_draft if layer_end is None else layer_end
            return SendCall(token_start, token_end, layer_start, end, last, ready)
        n_model = sl.num_model_layers
        end = n_model + n_draft if layer_end is None else layer_end
        if not 0 <= layer_start <= end <= n_model + n_draft:
            raise ValueError(f"room send: layers [{layer_start}, {end}) outside [0, {n_model + n_draft})")
        a, b = min(layer_start, n_model), min(end, n_model)  # the target's part
        try:
            k0, k1 = sl.kv_range(a, b)
            j0, j1 = sl.linear_range(a, b) if state else (0, 0)
        except ValueError as e:
            raise ValueError(f"room send: {e}") from e
        if end > n_model:  # draft layers: the KV buffers after the target's
            k0 = k0 if layer_start < n_model else self.layout.num_layers + layer_start - n_model
            k1 = self.layout.num_layers + end - n_model
        return SendCall(token_start, token_end, k0, k1, last, ready, (j0, j1))

    def abort(self, room: int, reason: str = "aborted by prefill") -> None:
        """Fail the room and tell its decode; poll() reports it once in-flight writes finished."""
        with self._lock:
            self._book.abort(room, reason, self._clock())
        self._wake.set()

    def poll(self) -> list[tuple[int, TransferState, str]]:
        """(room, Success | Failed, reason) of rooms whose pages the engine may free now; once each."""
        with self._lock:
            return self._book.poll(self._clock())

    def take_timings(self) -> list[TransferTiming]:
        """How rooms that succeeded since the last call used the link (oldest first)."""
        with self._lock:
            out = list(self._book.timings)
            self._book.timings.clear()
        return out

    def room_state(self, room: int) -> TransferState | None:
        """Current state of an active room (None once reported by poll, or unknown)."""
        with self._lock:
            r = self._book.rooms.get(room)
            return None if r is None else r.rec.state

    def unreachable(self) -> str | None:
        """Why this rank has no decode to send to (readiness), or None: one is alive, or none is known
        yet. The decodes it declared dead stay known until they speak again (sender/revivals.py: a
        decode looks for a prefill it lost on its own, receiver/lost.py) or are forgotten."""
        with self._lock:
            live = self._book.peers.liveness
            if not live.all_dead():
                return None
            return (
                f"no reachable decode: the {len(live.dead)} decode(s) prefill rank {self.tp_rank} knows sent "
                f"nothing for {self.cfg.heartbeat_timeout_s:.1f}s (heartbeats missed)"
            )

    def num_active_rooms(self) -> int:
        with self._lock:
            return sum(1 for r in self._book.rooms.values() if r.src_pages is not None)

    # ---- threads ---------------------------------------------------------------------------

    def _on_message(self, msg: object) -> None:
        with self._lock:
            self._book.on_message(msg, self._clock())
        self._wake.set()

    def _beat(self, now: float) -> None:
        with self._lock:
            self._book.heartbeats(now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            with self._pass_lock:
                busy = self._pass()
                stalled_s = self._clock() - self._progress_at
            if busy:
                # back off while nothing finishes (slow link), by a quarter of the time since the
                # last progress: a write of a few ms is seen done within ~1/4 of its time (doubling
                # the sleep saw it up to its whole time late), a slow one is polled at most every
                # max_tick_s; a new send() wakes us at once
                self._wake.wait(min(max(self.cfg.tuning.tick_s, stalled_s / 4), self.cfg.tuning.max_tick_s))
            else:
                self._wake.wait(self.cfg.tuning.idle_tick_s)

    def pump(self) -> None:
        """Run one pass of the worker on the calling thread now: what send() queued is planned
        and submitted before this returns. The engine calls it after the sends between two
        forwards, so a prompt's KV leaves without waiting for the worker thread to be scheduled
        (on a loaded core that wake-up cost ms of TTFT); the worker thread still polls it. If
        the worker is in a pass already, that pass or the next (woken now) takes the sends: waiting
        for it would queue the engine behind a thread that may not even be scheduled."""
        if self._stop.is_set():
            return
        if self._pass_lock.acquire(blocking=False):
            try:
                self._pass()
            finally:
                self._pass_lock.release()
        self._wake.set()  # the worker polls what was submitted here, or takes the sends

    def _pass(self) -> bool:
        """One round of the worker (caller holds _pass_lock): housekeeping, plan and submit queued
        sends, cancel, poll in-flight batches. Returns True while writes are queued or in flight."""
        try:
            with self._lock:
                now = self._clock()
                self._book.peers.liveness.observed(now, self.cfg.heartbeat_interval_s)
                for addr in self._book.housekeeping(now):
                    self._endpoint.disconnect(addr)
                take, cancels, watch = self._book.take_work(now)
                gathers = self._book.staged.take_gathers()
                relinks = self._book.take_relinks()
            for peer in relinks:  # before anything is written to it again (sender/revivals.py)
                self._relink(peer)
            if gathers:
                done = [(r, ch, self._gather(ch)) for r, ch in gathers]
                with self._lock:
                    self._book.staged.gathered(done, self._clock())
                self._wake.set()  # the slot requests are out: look again soon
            fresh = [(r, b, *self._submit(b)) for r, b in take]
            for inf, why in cancels:
                self.backend.cancel(inf.handle, why)
            polled = [(r, inf, self.backend.poll(inf.handle)) for r, inf in watch]
            moved = self._peers_moved({inf.handle.peer for _, inf in watch})
            progressed = bool(fresh or moved) or any(st is not BatchState.PENDING for _, _, st in polled)
            with self._lock:
                now = self._clock()
                for peer in moved:
                    self._book.peer_progressed(peer, now)
                busy = self._book.record(fresh, polled, now)
                news = self._book.has_news()
            if progressed or not busy:
                self._progress_at = now
            if news and self._on_news is not None:
                self._on_news()
            return busy
        except Exception:  # never let the worker die: rooms would hang until their deadlines
            log.exception("prefill rank %d transfer worker error", self.tp_rank)
            return False

    def _peers_moved(self, peers: set[str]) -> list[str]:
        """Peers whose writes the backend saw complete since the last pass (a piece of a batch
        counts: the book's stall check is per peer, and slow is not stuck)."""
        moved = []
        for peer in peers:
            t = self.backend.last_progress(peer)
            if t is not None and t != self._backend_progress.get(peer):
                self._backend_progress[peer] = t
                moved.append(peer)
        return moved

    def _relink(self, peer: str) -> None:
        try:
            if self.backend.relink(peer):
                log.warning(
                    "prefill rank %d: new connections to %s (it came back after it was declared dead)",
                    self.tp_rank,
                    peer,
                )
        except TransferError as e:  # the batches it failed say so; the worker goes on
            log.error("prefill rank %d: reconnecting to %s failed: %s", self.tp_rank, peer, e)

    def _gather(self, ch: StagedChunk) -> str | None:
        assert self._stager is not None and ch.local is not None
        try:
            self._stager.gather(ch.local.offset, ch.src_pages, ch.src_col, ch.ncols, ch.l0, ch.l1)
            return None
        except Exception as e:  # fails the room, never the worker
            log.exception("prefill rank %d: staging gather of chunk %d failed", self.tp_rank, ch.chunk)
            return f"{type(e).__name__}: {e}"

    def _submit(self, b: OpBatch) -> tuple[BatchHandle | None, str | None]:
        try:
            return self.backend.submit(b.peer, b.src, b.dst, b.length), None
        except (TransferError, ValueError) as e:
            return None, str(e)
