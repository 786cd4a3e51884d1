"""What a decode rank's staging agent decides, without threads, sockets or tensors.

The agent owns one staging ring (ring.py) in registered memory. Prefill ranks ask it for
slots (StagingSlotRequest), write their gathered chunk into the slot with one op, and announce it
(StagingChunkWritten); the agent scatters the chunk into the KV pages it names, frees the slot and
answers StagingChunkDone. Rules it keeps:
- a slot is granted only from bytes the watermark has passed: a writer never overwrites a chunk
  not yet scattered; a full ring queues requests FIFO and grants them as slots are freed;
- a request larger than the whole ring is refused at once (the prefill fails the room with it);
- every index of an announced chunk is checked against this rank's own pool before any scatter;
- a slot is freed whatever happens to its room: scattered, released by the prefill (its room
  failed or was aborted), or never announced within `lease_s` (its prefill died or stalled);
- an announcement or release counts only with the nonce of the chunk's request (messages.py): a
  frame that names another session's chunk without it changes nothing (`stats.foreign`);
- a prefill session has at most `max_waits` requests queued, and the queue at most
  `max_waits * WAITING_SESSIONS` (a refused request is answered at once, as an oversized one).

`StagingBook` returns the control messages to send as (address, message) pairs and the scatters
to run as `ScatterJob`s; the shell (buffers.py: StagingAgent) runs them and reports back with `scattered`.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import numpy as np

from kvpipe.transfer.control.messages import StagingChunkDone, StagingChunkWritten, StagingSlotGrant, StagingSlotRequest
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.staging.ring import RingAllocator, Slot
from kvpipe.transfer.staging.waits import WaitCounts

log = logging.getLogger(__name__)

Outbox = list[tuple[str, object]]
ChunkKey = tuple[str, int]  # (prefill session, chunk id)
WAITING_SESSIONS = 16  # the whole queue holds max_waits of this many prefill sessions


@dataclass(frozen=True)
class ScatterJob:
    """Copy a slot's bytes [layers, K/V, pages, slice_nbytes] into KV pages (buffers.py)."""

    key: ChunkKey
    offset: int  # slot start in the ring
    dst_pages: np.ndarray  # [n] int64
    page_offset: int
    slice_nbytes: int
    layer_start: int
    layer_end: int


@dataclass
class _Grant:
    slot: Slot
    room: int
    reply_address: str
    granted_at: float
    nonce: int  # the request's


@dataclass
class StagingStats:
    granted: int = 0
    scattered: int = 0
    released: int = 0  # freed without a scatter (room failed, or the prefill gave up waiting)
    expired: int = 0  # leases that ran out
    refused: int = 0  # oversized or duplicate requests
    rejected: int = 0  # announcements that failed validation or named no live slot
    waited: int = 0  # requests that found the ring full and queued
    foreign: int = 0  # announcements / releases without the nonce of the chunk they name
    auth_rejected: int = 0  # control frames the agent's endpoint dropped (no valid tag, stale, replayed)


class StagingBook:
    def __init__(self, layout: KVLayout, capacity: int, session_id: str, lease_s: float, max_waits: int = 64) -> None:
        self.layout, self.session_id, self.lease_s = layout, session_id, lease_s
        self.max_waits = max_waits
        self._waits: collections.Counter[str] = collections.Counter()  # queued requests per prefill session
        self.ring = RingAllocator(capacity)
        self.stats = StagingStats()
        self.grants: dict[ChunkKey, _Grant] = {}
        self.waiting: collections.OrderedDict[ChunkKey, tuple[StagingSlotRequest, float]] = collections.OrderedDict()
        self.scattering: dict[ChunkKey, _Grant] = {}  # handed to the shell, not yet reported
        self.waits = WaitCounts()  # per granted request: how long it queued for the ring (0: not at all)

    # ---- messages ----------------------------------------------------------------------------
    def on_request(self, msg: StagingSlotRequest, now: float) -> Outbox:
        key = (msg.session_id, msg.chunk)
        if key in self.grants or key in self.waiting or key in self.scattering:
            self.stats.refused += 1
            return [(msg.reply_address, self._grant_msg(msg, None, f"chunk {msg.chunk} already has a slot"))]
        if not 0 < msg.nbytes <= self.ring.capacity:  # refused before it can wait: it would never fit
            self.stats.refused += 1
            why = (
                f"a staging chunk of {msg.nbytes} bytes is larger than the {self.ring.capacity}-byte staging ring"
                if msg.nbytes > 0
                else "an empty staging chunk"
            )
            return [(msg.reply_address, self._grant_msg(msg, None, why))]
        if self.waiting and (
            self._waits[msg.session_id] >= self.max_waits or len(self.waiting) >= self.max_waits * WAITING_SESSIONS
        ):
            self.stats.refused += 1
            n = self._waits[msg.session_id]
            why = f"{n} chunks of this session (and {len(self.waiting)} in all) wait for the staging ring"
            return [(msg.reply_address, self._grant_msg(msg, None, why))]
        if self.waiting:  # FIFO: nobody jumps the queue of a full ring
            self._wait(key, msg, now)
            return []
        slot = self.ring.alloc(msg.nbytes)
        if slot is None:
            self._wait(key, msg, now)
            return []
        self.waits.observe(0.0)
        return [self._grant(key, msg, slot, now)]

    def on_written(self, msg: StagingChunkWritten, now: float) -> tuple[ScatterJob | None, Outbox]:
        """An announced chunk: the scatter to run, or (release / reject) what to answer."""
        key = (msg.session_id, msg.chunk)
        queued = self.waiting.get(key)
        live = self.grants.get(key)
        if (queued is not None and queued[0].nonce != msg.nonce) or (live is not None and live.nonce != msg.nonce):
            self.stats.foreign += 1  # not from the prefill that asked: answer nothing, keep the slot
            log.warning("staging agent %s: chunk %d announced without its nonce, ignored", self.session_id, msg.chunk)
            return None, []
        if not msg.scatter:  # the prefill gave the chunk up: free its slot or its place in the queue
            if queued is not None:
                self._unwait(key)
                self.stats.released += 1
                return None, self._pump(now)  # the requests behind it may fit now
            g = self.grants.pop(key, None)
            if g is None:
                return None, []  # never granted, or freed already (lease): nothing to do
            self.stats.released += 1
            self.ring.free(g.slot.slot_id)
            return None, self._pump(now)
        g = self.grants.get(key)
        if g is None:
            self.stats.rejected += 1
            return None, [
                (
                    msg.reply_address,
                    StagingChunkDone(
                        msg.room,
                        msg.chunk,
                        self.session_id,
                        False,
                        f"chunk {msg.chunk} holds no slot here (lease expired?)",
                        nonce=msg.nonce,
                    ),
                )
            ]
        why = self._check(msg, g)
        if why is not None:
            self.stats.rejected += 1
            del self.grants[key]
            self.ring.free(g.slot.slot_id)
            log.warning("staging agent %s rejected chunk %d of room %d: %s", self.session_id, msg.chunk, msg.room, why)
            return None, [(g.reply_address, self._done_msg(msg.room, msg.chunk, g.nonce, False, why)), *self._pump(now)]
        del self.grants[key]
        self.scattering[key] = g
        return ScatterJob(
            key,
            g.slot.offset,
            np.asarray(msg.dst_pages, dtype=np.int64),
            msg.page_offset,
            msg.slice_nbytes,
            msg.layer_start,
            msg.layer_end,
        ), []

    def scattered(self, job: ScatterJob, error: str | None, now: float) -> Outbox:
        """The shell ran (or failed to run) a scatter: free the slot and answer the prefill."""
        g = self.scattering.pop(job.key)
        self.ring.free(g.slot.slot_id)
        if error is None:
            self.stats.scattered += 1
        out = [(g.reply_address, self._done_msg(g.room, job.key[1], g.nonce, error is None, error or ""))]
        return out + self._pump(now)

    # ---- clock --------------------------------------------------------------------------------
    def expire(self, now: float) -> Outbox:
        """Free slots granted `lease_s` ago and never announced; drop requests queued that long."""
        for key in [k for k, g in self.grants.items() if now - g.granted_at > self.lease_s]:
            g = self.grants.pop(key)
            self.ring.free(g.slot.slot_id)
            self.stats.expired += 1
            log.warning(
                "staging agent %s: slot of chunk %d (room %d) never announced within %.0fs, freed",
                self.session_id,
                key[1],
                g.room,
                self.lease_s,
            )
        out: Outbox = []
        for key in [k for k, (_, t) in self.waiting.items() if now - t > self.lease_s]:
            req = self._unwait(key)
            self.stats.expired += 1
            out.append((req.reply_address, self._grant_msg(req, None, f"staging ring full for {self.lease_s:.0f}s")))
        return out + self._pump(now)

    # ---- inside ---------------------------------------------------------------------------------
    def _wait(self, key: ChunkKey, msg: StagingSlotRequest, now: float) -> None:
        self.stats.waited += 1
        self.waiting[key] = (msg, now)
        self._waits[key[0]] += 1

    def _unwait(self, key: ChunkKey) -> StagingSlotRequest:
        req, _ = self.waiting.pop(key)
        self._waits[key[0]] -= 1
        if not self._waits[key[0]]:
            del self._waits[key[0]]
        return req

    def _pump(self, now: float) -> Outbox:
        """Grant queued requests in order while the ring has room."""
        out: Outbox = []
        while self.waiting:
            key, (req, since) = next(iter(self.waiting.items()))
            slot = self.ring.alloc(req.nbytes)  # sizes were checked on arrival
            if slot is None:
                break
            self._unwait(key)
            self.waits.observe(now - since)
            out.append(self._grant(key, req, slot, now))
        return out

    def _grant(self, key: ChunkKey, msg: StagingSlotRequest, slot: Slot, now: float) -> tuple[str, object]:
        self.grants[key] = _Grant(slot, msg.room, msg.reply_address, now, msg.nonce)
        self.stats.granted += 1
        return msg.reply_address, self._grant_msg(msg, slot, "")

    def _grant_msg(self, msg: StagingSlotRequest, slot: Slot | None, reason: str) -> StagingSlotGrant:
        if slot is None:
            return StagingSlotGrant(msg.room, msg.chunk, self.session_id, False, 0, reason, msg.nonce)
        return StagingSlotGrant(msg.room, msg.chunk, self.session_id, True, slot.offset, nonce=msg.nonce)

    def _done_msg(self, room: int, chunk: int, nonce: int, ok: bool, reason: str) -> StagingChunkDone:
        rnd, off = self.ring.watermark
        return StagingChunkDone(room, chunk, self.session_id, ok, reason, rnd, off, nonce)

    def _check(self, msg: StagingChunkWritten, g: _Grant) -> str | None:
        """Every index against this rank's own pool: a bad chunk must not scatter anywhere."""
        lay = self.layout
        n = len(msg.dst_pages)
        if msg.room != g.room:
            return f"chunk {msg.chunk} was granted for room {g.room}, announced for room {msg.room}"
        if not 0 <= msg.layer_start < msg.layer_end <= lay.num_layers:
            return f"layers [{msg.layer_start}, {msg.layer_end}) outside [0, {lay.num_layers})"
        if msg.slice_nbytes <= 0 or msg.page_offset < 0 or msg.page_offset + msg.slice_nbytes > lay.page_nbytes:
            return (
                f"bytes [{msg.page_offset}, {msg.page_offset + msg.slice_nbytes}) outside a {lay.page_nbytes}-byte page"
            )
        if n == 0:
            return "no destination pages"
        pages = np.asarray(msg.dst_pages, dtype=np.int64)
        if pages.min() < 0 or pages.max() >= lay.num_pages or np.unique(pages).size != n:
            return f"destination pages must be distinct ids in [0, {lay.num_pages})"
        nbytes = (msg.layer_end - msg.layer_start) * 2 * n * msg.slice_nbytes
        if nbytes != g.slot.nbytes:
            return f"chunk of {nbytes} bytes announced for a {g.slot.nbytes}-byte slot"
        return None
