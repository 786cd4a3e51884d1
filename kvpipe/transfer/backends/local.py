"""In-process backend: ops are ctypes.memmove between backends sharing one LocalFabric.

For unit tests and single-process use. It checks every op against registered memory on both
sides (an unchecked memmove to a wrong address would crash the process instead of failing the
batch), and copies at submit time, so a batch is terminal as soon as `submit` returns.
"""

from __future__ import annotations

import ctypes
import itertools
import threading

import numpy as np

from kvpipe.config import FaultInjection
from kvpipe.transfer.backends.base import (
    BackendOptions,
    BatchHandle,
    BatchState,
    TransferBackend,
    TransferError,
    _Injector,
    as_op_arrays,
)


class LocalFabric:
    """Name service connecting LocalBackends of one process (what the network is to Mooncake)."""

    def __init__(self) -> None:
        self._backends: dict[str, LocalBackend] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def attach(self, backend: LocalBackend) -> str:
        with self._lock:
            address = f"local:{next(self._ids)}"
            self._backends[address] = backend
            return address

    def detach(self, address: str) -> None:
        with self._lock:
            self._backends.pop(address, None)

    def lookup(self, address: str) -> LocalBackend | None:
        with self._lock:
            return self._backends.get(address)


class _Regions:
    """Registered [addr, addr + nbytes) ranges; vectorised containment checks."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}
        self._starts = np.zeros(0, dtype=np.int64)
        self._ends = np.zeros(0, dtype=np.int64)

    def add(self, addr: int, nbytes: int) -> None:
        self._ranges[addr] = addr + nbytes
        self._rebuild()

    def remove(self, addr: int) -> None:
        if self._ranges.pop(addr, None) is None:
            raise TransferError(f"address {addr:#x} was not registered")
        self._rebuild()

    def _rebuild(self) -> None:
        starts = sorted(self._ranges)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._ends = np.asarray([self._ranges[s] for s in starts], dtype=np.int64)

    def contains(self, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """[N] bool: op i lies inside one registered range."""
        if self._starts.size == 0:
            return np.zeros(addrs.shape, dtype=bool)
        idx = np.searchsorted(self._starts, addrs, side="right") - 1
        safe = np.maximum(idx, 0)
        return (idx >= 0) & (addrs + lengths <= self._ends[safe])


class LocalBackend(TransferBackend):
    name = "local"

    def __init__(self, fabric: LocalFabric | None = None, inject: FaultInjection | None = None) -> None:
        self._fabric = fabric if fabric is not None else LocalFabric()
        self._address = self._fabric.attach(self)
        self._regions = _Regions()
        self._injector = _Injector(inject)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_options(cls, options: BackendOptions) -> LocalBackend:
        return cls(inject=options.inject)  # a fabric of its own: nothing outside it can reach it

    def sibling(self, inject: FaultInjection | None = None) -> LocalBackend:
        return LocalBackend(self._fabric, inject)

    @property
    def fabric(self) -> LocalFabric:
        return self._fabric

    @property
    def address(self) -> str:
        return self._address

    def register(self, addr: int, nbytes: int) -> None:
        if addr <= 0 or nbytes <= 0:
            raise TransferError(f"cannot register {nbytes} bytes at {addr:#x}")
        with self._lock:
            self._regions.add(addr, nbytes)

    def unregister(self, addr: int) -> None:
        with self._lock:
            self._regions.remove(addr)

    def submit(self, peer: str, src_addrs, dst_addrs, lengths) -> BatchHandle:
        if self._closed:
            raise TransferError("backend is closed")
        s, d, n = as_op_arrays(src_addrs, dst_addrs, lengths)
        handle = BatchHandle(next(self._ids), peer, int(n.size), int(n.sum()))
        target = self._fabric.lookup(peer)
        if target is None:
            handle._finish(BatchState.FAILED, f"unknown peer {peer!r}")
            return handle
        with self._lock:
            src_ok = self._regions.contains(s, n)
        with target._lock:
            dst_ok = target._regions.contains(d, n)
        valid = src_ok & dst_ok
        limit = self._injector.ops_before_failure(int(n.size))
        # Like a real link, ops before the first bad one land; nothing after it is issued.
        first_bad = int(np.argmin(valid)) if not valid.all() else int(n.size)
        stop = min(first_bad, limit if limit is not None else n.size)
        for src, dst, size in zip(s[:stop].tolist(), d[:stop].tolist(), n[:stop].tolist()):
            ctypes.memmove(dst, src, size)
        if first_bad < n.size and first_bad == stop:
            side = "source" if not src_ok[first_bad] else f"peer {peer!r}"
            handle._finish(
                BatchState.FAILED,
                f"op {first_bad}: {int(n[first_bad])} bytes at "
                f"{int((s if side == 'source' else d)[first_bad]):#x} outside {side}'s registered memory",
            )
        elif limit is not None:
            handle._finish(BatchState.FAILED, f"injected failure after {limit} of {n.size} ops")
        else:
            handle._finish(BatchState.DONE)
        return handle

    def poll(self, handle: BatchHandle) -> BatchState:
        return handle.state

    def cancel(self, handle: BatchHandle, reason: str = "cancelled") -> None:
        handle._finish(BatchState.FAILED, reason)  # no-op: local batches finish inside submit

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._fabric.detach(self._address)
