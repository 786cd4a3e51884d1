"""Staging buffers for heterogeneous-TP KV transfer: the tensor side and the decode's agent.

With different TP sizes a decode rank needs a head slice of every prefill page, which is strided:
one write per (layer, K/V, page). Staging turns a send's slices into one contiguous chunk:

    prefill rank                                   decode rank r
    gather KV[l, k/v][pages, heads] -> buffer      StagingAgent: ring over a registered pool
    StagingSlotRequest(nbytes)   ----------------> grant a slot (FIFO wait while the ring is full)
                                 <---------------- StagingSlotGrant(offset)
    one write: buffer -> ring[offset]  ==========>
    StagingChunkWritten(pages, heads, layers) ---> scatter ring[offset] into its KV pages, free
                                 <---------------- StagingChunkDone (the prefill's final
                                                   TransferStatus waits for every Done)

Chunk layout in both buffers: [layer_end - layer_start, 2 (K, V), pages, slice_nbytes] bytes, the
slice being bytes [col, col + slice_nbytes) of each page (a contiguous head range, planning/layout.py).
`KVBytes` does the tensor work (one index op per (layer, K/V)); the bookkeeping is in
ring.py (allocation), book.py (the agent's protocol) and sender/staged_sends.py.
CUDA: gathers and scatters run on a side stream that is synchronised before the bytes are
written or announced as scattered.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kvpipe.config import ControlLimits, PortRange
from kvpipe.transfer.backends.base import TransferBackend
from kvpipe.transfer.control.auth import Authenticator
from kvpipe.transfer.control.endpoint import ControlEndpoint
from kvpipe.transfer.control.messages import (
    STAGING_AGENT_RECEIVES,
    StagingChunkWritten,
    StagingInfo,
    StagingSlotRequest,
    limits_for,
)
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.staging.book import Outbox, ScatterJob, StagingBook, StagingStats

log = logging.getLogger(__name__)


# Widest element a byte range can be moved as: on CPU index_copy_ runs ~9x faster on int64 rows
# than on bytes (5.7 vs 0.64 GB/s, one core; index_select 19 GB/s either way).
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class KVBytes:
    """A rank's KV buffers (layer-major, K then V: KVPool order) as matrices [pages, page_nbytes / w]
    of w-byte words, w the widest that divides every offset and length of a move."""

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        self.bytes = [b.view(torch.uint8).view(b.shape[0], -1) for b in buffers]
        self.device = buffers[0].device
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._views: dict[int, list[torch.Tensor]] = {}

    def _words(self, *nbytes: int) -> tuple[int, list[torch.Tensor], torch.dtype]:
        w, dtype = next((w, d) for w, d in _WORDS if all(n % w == 0 for n in (*nbytes, self.bytes[0].shape[1])))
        if w not in self._views:
            self._views[w] = [b.view(dtype) for b in self.bytes]
        return w, self._views[w], dtype

    @classmethod
    def from_pool(cls, pool) -> KVBytes:
        if pool.latent:  # chunks are [layers, K/V, pages, slice]; a latent is never head-sliced anyway
            raise ValueError("staging moves head slices of K and V; an MLA latent pool has neither")
        return cls(pool.buffers())

    def _chunk(
        self, buf: torch.Tensor, offset: int, n: int, ncols: int, l0: int, l1: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """[2 * layers, n, ncols / w] words of the chunk at byte `offset` of a byte buffer."""
        nbytes = (l1 - l0) * 2 * n * ncols
        return buf[offset : offset + nbytes].view(dtype).view(2 * (l1 - l0), n, -1)

    def _on_side_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def gather(self, out: torch.Tensor, offset: int, pages: np.ndarray, col: int, ncols: int, l0: int, l1: int) -> None:
        """out[offset:] <- bytes [col, col+ncols) of `pages` in layers [l0, l1), K and V."""
        self._move(out, offset, pages, col, ncols, l0, l1, to_pool=False)

    def scatter(
        self, src: torch.Tensor, offset: int, pages: np.ndarray, col: int, ncols: int, l0: int, l1: int
    ) -> None:
        """bytes [col, col+ncols) of `pages` in layers [l0, l1), K and V <- src[offset:]."""
        self._move(src, offset, pages, col, ncols, l0, l1, to_pool=True)

    def _move(
        self,
        staging: torch.Tensor,
        offset: int,
        pages: np.ndarray,
        col: int,
        ncols: int,
        l0: int,
        l1: int,
        to_pool: bool,
    ) -> None:
        w, views, dtype = self._words(offset, col, ncols)
        idx = torch.as_tensor(pages, dtype=torch.int64).to(self.device)
        chunk = self._chunk(staging, offset, idx.numel(), ncols, l0, l1, dtype)
        c0, c1 = col // w, (col + ncols) // w
        with self._on_side_stream():
            for i, b in enumerate(range(2 * l0, 2 * l1)):
                if to_pool:
                    views[b][:, c0:c1].index_copy_(0, idx, chunk[i])
                else:
                    torch.index_select(views[b][:, c0:c1], 0, idx, out=chunk[i])
        self._sync()


def registered_buffer(backend: TransferBackend, nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed byte buffer registered with the backend (touched now: see KVPool on lazy faults)."""
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    backend.register(buf.data_ptr(), nbytes)
    return buf


class StagingBuffer:
    """A prefill rank's local staging memory: the source of staged writes (the book allocates it)."""

    def __init__(self, kv: KVBytes, backend: TransferBackend, nbytes: int) -> None:
        self.kv, self.nbytes = kv, nbytes
        self.buffer = registered_buffer(backend, nbytes, kv.device)
        self.addr = self.buffer.data_ptr()

    def gather(self, offset: int, pages: np.ndarray, col: int, ncols: int, l0: int, l1: int) -> None:
        self.kv.gather(self.buffer, offset, pages, col, ncols, l0, l1)


class StagingAgent:
    """A decode rank's staging ring: its own control endpoint, a registered pool, the scatters.

    Runs in the process that owns the rank's KV pool (the scatter writes its pages): rank 0's
    with the KVReceiver, the others in their TP worker. Scatters run on the endpoint's receive
    thread, in arrival order; a second thread expires leases. Its session is `session_id` plus
    128 random bits (StagingInfo.session_id: only the prefill ranks it registers with see it)."""

    def __init__(
        self,
        layout: KVLayout,
        kv: KVBytes,
        backend: TransferBackend,
        nbytes: int,
        *,
        host: str,
        session_id: str,
        lease_s: float,
        send_hwm: int = 10000,
        auth: Authenticator | None = None,
        limits: ControlLimits | None = None,
        ports: PortRange | None = None,
    ) -> None:
        """`ports`: where its control endpoint listens (--disaggregation-control-ports; None: any free port)."""
        limits = limits or ControlLimits()
        self.kv = kv
        self.ring = registered_buffer(backend, nbytes, kv.device)
        session_id = f"{session_id}/{secrets.token_hex(16)}"
        self._book = StagingBook(layout, nbytes, session_id, lease_s, limits.max_staging_waits_per_session)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._endpoint = ControlEndpoint(
            host,
            self._on_message,
            name=f"staging-{session_id}",
            send_hwm=send_hwm,
            auth=auth,
            limits=limits_for(STAGING_AGENT_RECEIVES, layout.num_pages),  # page lists of this rank's pool
            max_sockets=limits.max_reply_sockets,
            ports=ports,
        )
        self._thread = threading.Thread(target=self._run, name=f"staging-{session_id}", daemon=True)
        self._tick_s = min(1.0, lease_s / 4)

    @property
    def info(self) -> StagingInfo:
        book = self._book
        return StagingInfo(self._endpoint.address, self.ring.data_ptr(), book.ring.capacity, book.session_id)

    @property
    def stats(self) -> StagingStats:
        return replace(self._book.stats, auth_rejected=self._endpoint.stats.auth_rejected)

    def waits(self) -> dict[str, Any]:
        """How long granted slot requests waited for the ring (waits.py), as plain data."""
        with self._lock:
            return self._book.waits.as_dict()

    def usage(self) -> tuple[int, int, int]:
        """(live slots, bytes held back by the watermark, requests waiting) right now."""
        with self._lock:
            return self._book.ring.num_live, self._book.ring.used_bytes, len(self._book.waiting)

    def start(self) -> StagingAgent:
        self._endpoint.start()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._endpoint.close()

    def _send(self, out: Outbox) -> None:
        for addr, msg in out:
            self._endpoint.send(addr, msg)

    def _on_message(self, msg: object) -> None:
        now = time.monotonic()
        if isinstance(msg, StagingSlotRequest):
            with self._lock:
                out = self._book.on_request(msg, now)
            return self._send(out)
        if not isinstance(msg, StagingChunkWritten):
            log.warning("staging agent got an unexpected %s", type(msg).__name__)
            return
        with self._lock:
            job, out = self._book.on_written(msg, now)
        self._send(out)
        if job is not None:
            self._send(self._scatter(job))

    def _scatter(self, job: ScatterJob) -> Outbox:
        err = None
        try:
            self.kv.scatter(
                self.ring, job.offset, job.dst_pages, job.page_offset, job.slice_nbytes, job.layer_start, job.layer_end
            )
        except Exception as e:  # a failed scatter fails its room, never the agent
            log.exception("staging scatter of chunk %d failed", job.key[1])
            err = f"scatter failed: {type(e).__name__}: {e}"
        with self._lock:
            return self._book.scattered(job, err, time.monotonic())

    def _run(self) -> None:
        while not self._stop.wait(self._tick_s):
            try:
                with self._lock:
                    out = self._book.expire(time.monotonic())
                self._send(out)
            except Exception:
                log.exception("staging agent housekeeping error")
