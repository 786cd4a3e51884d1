"""Transfer backend interface: one-sided batched writes into a peer's registered memory.

Lifecycle: the receiving side registers its KV buffers once in its own backend (`register`)
and tells each sender once (RegisterPeer: its `address` and the buffer addresses). A sender
then writes with `submit(peer_address, ...)`; it registers nothing per request or per peer.
A write to memory the peer has not registered fails the batch.

A batch is terminal (DONE or FAILED) only when none of its writes can still land, so the
receiver may reuse pages as soon as the sender reports the outcome.
"""

from __future__ import annotations

import abc
import enum
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpipe.config import FaultInjection

if TYPE_CHECKING:  # numpy on use: the registry (what `kvpipe serve --help` parses with) loads this module
    import numpy as np


class TransferError(RuntimeError):
    """A backend could not start, register memory or reach a peer."""


class BatchState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class BatchHandle:
    """One submitted batch. The backend updates it; callers read `state` / `error`.

    `num_ops` counts the ops as submitted (the planner's ops: what senders budget and report);
    `num_pieces` counts what the backend put on the wire, more when it splits long ops into
    pieces sized for its transport (Mooncake), else equal to `num_ops`.
    """

    def __init__(self, batch_id: int, peer: str, num_ops: int, nbytes: int, num_pieces: int | None = None) -> None:
        self.batch_id = batch_id
        self.peer = peer
        self.num_ops = num_ops
        self.num_pieces = num_ops if num_pieces is None else num_pieces
        self.nbytes = nbytes
        self.submitted_at = time.monotonic()
        self.finished_at: float | None = None
        self._state = BatchState.PENDING
        self._error: str | None = None

    @property
    def state(self) -> BatchState:
        return self._state

    @property
    def error(self) -> str | None:
        return self._error

    def _finish(self, state: BatchState, error: str | None = None) -> None:
        if self._state is BatchState.PENDING:  # terminal states never change again
            self._state, self._error, self.finished_at = state, error, time.monotonic()

    def __repr__(self) -> str:
        return (
            f"BatchHandle(id={self.batch_id}, peer={self.peer!r}, ops={self.num_ops}, pieces={self.num_pieces}, "
            f"{self._state.value})"
        )


class _Injector:
    def __init__(self, cfg: FaultInjection | None) -> None:
        self.prob = cfg.prob if cfg else 0.0
        self._rng = random.Random(cfg.seed if cfg else 0)
        self._failures_left = cfg.max_failures if cfg else None

    def ops_before_failure(self, num_ops: int) -> int | None:
        """None: the batch runs normally; else fail it after this many ops were written."""
        if self.prob <= 0.0 or self._failures_left == 0 or self._rng.random() >= self.prob:
            return None
        if self._failures_left is not None:
            self._failures_left -= 1
        return self._rng.randrange(num_ops + 1)


def as_op_arrays(src_addrs, dst_addrs, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import numpy as np

    s, d, n = (np.asarray(x, dtype=np.int64).ravel() for x in (src_addrs, dst_addrs, lengths))
    if not s.shape == d.shape == n.shape:
        raise ValueError(f"op arrays differ in length: {s.size}, {d.size}, {n.size}")
    if n.size and (n.min() <= 0 or s.min() <= 0 or d.min() <= 0):
        raise ValueError("op lengths and addresses must be positive")
    return s, d, n


@dataclass(frozen=True)
class BackendOptions:
    """What a server tells the backend it starts (registry.open_backend, from the
    --disaggregation-* flags); everything else about a backend is its own default."""

    host: str = "127.0.0.1"  # the data-plane address peers reach it at (a backend that crosses hosts)
    ib_device: str | None = None  # RDMA device (a backend with RDMA); None: its TCP path
    inject: FaultInjection | None = None  # test fault injection (FaultInjection's docstring)


class TransferBackend(abc.ABC):
    name: str = "base"  # its registry name (registry.py)

    @classmethod
    @abc.abstractmethod
    def from_options(cls, options: BackendOptions) -> TransferBackend:
        """The backend a server starts (registry.open_backend)."""

    @abc.abstractmethod
    def sibling(self, inject: FaultInjection | None = None) -> TransferBackend:
        """A new backend of this kind and configuration, in this process, that this one can write
        to and be written by (tests and benchmarks pair backends with it)."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """What peers pass as `peer` to write into this backend's registered memory."""

    @abc.abstractmethod
    def register(self, addr: int, nbytes: int) -> None:
        """Expose [addr, addr + nbytes) to peers' writes (and as a write source)."""

    def register_many(self, addrs: list[int], sizes: list[int]) -> None:
        for a, n in zip(addrs, sizes, strict=True):
            self.register(a, n)

    @abc.abstractmethod
    def unregister(self, addr: int) -> None: ...

    @abc.abstractmethod
    def submit(self, peer: str, src_addrs, dst_addrs, lengths) -> BatchHandle:
        """Start writing local [src, src+len) to the peer's [dst, dst+len) for every op."""

    @abc.abstractmethod
    def poll(self, handle: BatchHandle) -> BatchState:
        """Make progress without blocking; the batch's current state."""

    @abc.abstractmethod
    def cancel(self, handle: BatchHandle, reason: str = "cancelled") -> None:
        """Stop issuing the batch's remaining ops; it turns FAILED once nothing is in flight."""

    def last_progress(self, peer: str) -> float | None:
        """time.monotonic() when a write to `peer` last completed (None: this backend does not say).
        A sender's stall check counts it as progress of every batch to that peer: on a slow link
        that runs full a batch waits behind the others, and is not stuck (issue 50)."""
        return None

    def relink(self, peer: str) -> bool:
        """Drop the connections to `peer` that carry writes of ours still on the wire, so the next
        writes open fresh ones; True when it dropped any. A sender calls it when a peer it declared
        dead speaks again: a connection that had data on the wire through the outage sits in TCP's
        retransmission back-off, seconds behind the link (issue 50). Batches with writes on the wire
        to `peer` fail; others carry on. A backend without long-lived connections has nothing to drop.
        """
        return False

    def wait(self, handle: BatchHandle, deadline: float | None = None, poll_interval_s: float = 100e-6) -> BatchState:
        """Poll until terminal or `deadline` (time.monotonic()); PENDING means the deadline passed.

        Sleeps between polls: Mooncake's own blocking waits busy-spin a core (half the throughput on 2 cores).
        """
        while True:
            state = self.poll(handle)
            if state is not BatchState.PENDING or (deadline is not None and time.monotonic() >= deadline):
                return state
            time.sleep(poll_interval_s)

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
