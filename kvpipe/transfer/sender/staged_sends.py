"""A prefill rank's staged chunks (heterogeneous TP through the decode's staging ring,
staging/buffers.py): gather -> slot -> one write -> scatter, decided without I/O.

A planned span becomes `StagedChunk`s (room.py); each walks ChunkState: NEW (waits for local
staging space) -> GATHERING (the worker gathers its head slices into local staging, then
`gathered`) -> WAIT_SLOT (asked the decode's staging agent for a ring slot) -> GRANTED (its one
write is queued behind the room's page ops) -> WRITING (in flight; `written` with the outcome) ->
WAIT_DONE (announced for scattering; the agent's StagingChunkDone ends it).

A chunk holds local staging bytes from gather to the end of its write and a decode ring slot from
grant to scatter; whatever happens to its room the slot is released (StagingChunkWritten with
scatter=False) or scattered, and the room's final status waits for every scatter the decode
acknowledges (or transfer_timeout_s). A grant or done counts only from the agent session the
destination announced, with the chunk's nonce. SenderBook owns one `StagedSends` and calls it
under its lock.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpipe.transfer.control.messages import StagingChunkDone, StagingChunkWritten, StagingSlotGrant, StagingSlotRequest
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.sender.plan_types import ChunkState, OpBatch, StagedChunk, StagingPolicy
from kvpipe.transfer.sender.room import SenderRoom
from kvpipe.transfer.sender.stats import SenderStats
from kvpipe.transfer.staging.ring import RingAllocator

log = logging.getLogger(__name__)
F = TransferState.FAILED


class StagedSends:
    def __init__(
        self,
        policy: StagingPolicy | None,
        staging_addr: int,
        *,
        tp_rank: int,
        session_id: str,
        control_address: str,
        send: Callable[[str, Any], bool],
        stats: SenderStats,
        transfer_timeout_s: float,
    ) -> None:
        """`policy` None: this rank never stages. `staging_addr`: the local staging buffer's base;
        `control_address`: where staging agents answer."""
        self.policy, self.staging_addr = policy, staging_addr
        self.local_ring = RingAllocator(policy.local_nbytes) if policy is not None else None
        self.chunk_ids = itertools.count()
        self.tp_rank, self.session_id, self.control_address = tp_rank, session_id, control_address
        self.send, self.stats, self.transfer_timeout_s = send, stats, transfer_timeout_s
        self._gathers: list[tuple[SenderRoom, StagedChunk]] = []  # for the worker: gather, then gathered()
        self.dirty = False  # a chunk ended or asked for a slot: SenderBook scans every room next tick

    def take_gathers(self) -> list[tuple[SenderRoom, StagedChunk]]:
        """Chunks whose slices the worker must gather into local staging now (then `gathered`)."""
        out, self._gathers = self._gathers, []
        return out

    def gathered(self, done: list[tuple[SenderRoom, StagedChunk, str | None]], now: float) -> None:
        """The worker gathered these chunks (or failed: why): ask their agents for slots."""
        for r, ch, err in done:
            if err is not None:
                r.rec.fail(f"staging gather failed: {err}", now)
            dest = r.dests[ch.dest]
            if r.rec.state is F:
                self.finish(r, ch)
                continue
            assert dest.staging is not None
            ch.state, ch.since = ChunkState.WAIT_SLOT, now
            self.send(
                dest.staging.control_address,
                StagingSlotRequest(r.room, self.session_id, ch.chunk, ch.nbytes, self.control_address, ch.nonce),
            )
        self.dirty = True

    def step(self, r: SenderRoom, now: float) -> None:
        """Move a room's staged chunks on: local space for new ones, writes for granted ones;
        a failed room releases what it can and waits for what it cannot."""
        failed = r.rec.state is F
        for ch in list(r.staged.values()):
            st, age = ch.state, now - ch.since
            if failed:
                if st is ChunkState.NEW:
                    self.finish(r, ch)
                elif st in (ChunkState.WAIT_SLOT, ChunkState.GRANTED):
                    self.release(r, ch)
                elif st is ChunkState.WAIT_DONE and age > self.transfer_timeout_s:
                    log.warning(
                        "prefill rank %d: decode never confirmed the scatter of chunk %d (room %d)",
                        self.tp_rank,
                        ch.chunk,
                        r.room,
                    )
                    self.finish(r, ch)
                continue  # GATHERING / WRITING: their outcome comes back through gathered / record
            if st in (ChunkState.WAIT_SLOT, ChunkState.WAIT_DONE) and age > self.transfer_timeout_s:
                what = "no staging slot granted" if st is ChunkState.WAIT_SLOT else "the chunk was not scattered"
                r.rec.fail(
                    f"decode rank {r.dests[ch.dest].decode_rank}: {what} within {self.transfer_timeout_s:.0f}s", now
                )
                return self.step(r, now)
            if st is ChunkState.NEW:
                assert self.local_ring is not None
                slot = self.local_ring.alloc(ch.nbytes)  # chunks are sized to fit (room.py, SenderRoom._stage)
                if slot is None:
                    continue  # local staging is full: wait for writes to finish
                ch.local, ch.state, ch.since = slot, ChunkState.GATHERING, now
                self._gathers.append((r, ch))
            elif st is ChunkState.GRANTED:  # one op, queued behind the room's page ops
                assert ch.local is not None and ch.offset is not None
                dest = r.dests[ch.dest]
                assert dest.staging is not None
                ch.state, ch.since = ChunkState.WRITING, now
                one = lambda v: np.asarray([v], dtype=np.int64)  # noqa: E731
                r.queued.append(
                    OpBatch(
                        dest.data_address,
                        one(self.staging_addr + ch.local.offset),
                        one(dest.staging.pool_addr + ch.offset),
                        one(ch.nbytes),
                        ch,
                    )
                )

    def on_message(self, r: SenderRoom | None, msg: StagingSlotGrant | StagingChunkDone, now: float) -> str | None:
        """A staging agent's grant or done for a chunk of room `r` (None: gone); returns why the
        frame is rejected, or None."""
        ch = r.staged.get(msg.chunk) if r is not None else None
        if r is None or ch is None:
            return None  # a chunk released meanwhile (its agent frees the slot on our release)
        agent = r.dests[ch.dest].staging
        if agent is None or msg.session_id != agent.session_id or msg.nonce != ch.nonce:
            self.stats.foreign_rejected += 1
            return (
                f"{type(msg).__name__} for chunk {msg.chunk} of room {msg.room} from session "
                f"{msg.session_id!r:.80}: not the chunk's staging agent, or not its nonce"
            )
        if isinstance(msg, StagingSlotGrant):
            if ch.state is not ChunkState.WAIT_SLOT:
                return f"staging grant for chunk {msg.chunk} in state {ch.state.value}"
            if not msg.ok:
                r.rec.fail(f"decode rank {r.dests[ch.dest].decode_rank} refused a staging slot: {msg.reason}", now)
                self.finish(r, ch)
                return None
            staging = r.dests[ch.dest].staging
            assert staging is not None
            ch.state, ch.since, ch.offset = ChunkState.GRANTED, now, msg.offset
            if msg.offset + ch.nbytes <= staging.pool_nbytes:
                return None
            r.rec.fail(
                f"staging slot at {msg.offset} for {ch.nbytes} bytes overruns the decode's "
                f"{staging.pool_nbytes}-byte ring",
                now,
            )
            self.release(r, ch)
            return f"staging grant for chunk {msg.chunk} at {msg.offset} overruns the decode's ring"
        if ch.state is not ChunkState.WAIT_DONE:
            return f"staging done for chunk {msg.chunk} in state {ch.state.value}"
        if msg.ok:
            self.stats.staged_chunks += 1
            self.stats.staged_bytes += ch.nbytes
        else:
            r.rec.fail(
                f"decode rank {r.dests[ch.dest].decode_rank} could not scatter a staged chunk: {msg.reason}", now
            )
        self.finish(r, ch)
        return None

    def written(self, r: SenderRoom, ch: StagedChunk, ok: bool, now: float) -> None:
        """The chunk's write ended: announce it for scattering, or (room failed) release the slot."""
        if not ok or r.rec.state is F:
            return self.release(r, ch)
        dest = r.dests[ch.dest]
        assert dest.staging is not None and self.local_ring is not None and ch.local is not None
        self.local_ring.free(ch.local.slot_id)  # the bytes are on the decode now
        ch.local, ch.state, ch.since = None, ChunkState.WAIT_DONE, now
        self.send(
            dest.staging.control_address,
            StagingChunkWritten(
                r.room,
                ch.chunk,
                self.session_id,
                self.control_address,
                True,
                tuple(ch.dst_pages.tolist()),
                ch.dst_col,
                ch.ncols,
                ch.l0,
                ch.l1,
                ch.nonce,
            ),
        )

    def release(self, r: SenderRoom, ch: StagedChunk) -> None:
        """Give the chunk's decode slot back unscattered, and end the chunk."""
        staging = r.dests[ch.dest].staging
        assert staging is not None
        self.send(
            staging.control_address,
            StagingChunkWritten(r.room, ch.chunk, self.session_id, self.control_address, False, nonce=ch.nonce),
        )
        self.finish(r, ch)

    def finish(self, r: SenderRoom, ch: StagedChunk) -> None:
        """End the chunk: free its local staging bytes and forget it."""
        if ch.local is not None and self.local_ring is not None:
            self.local_ring.free(ch.local.slot_id)
            ch.local = None
        r.staged.pop(ch.chunk, None)
        self.dirty = True
