"""Model weights in one arena of transparent huge pages (2 MiB) on Linux CPUs.

Why: a batch-1 decode step streams every weight once, and on 4 KiB pages each page is a TLB
miss and a fresh start for the hardware prefetcher (it does not cross a 4 KiB page). Measured on
the 2-core AMD EPYC (Zen 4) of docs/benchmarks.md, one thread: kvpipe's fp32 GEMV read a
[3072, 576] weight at 20.6 GB/s on 4 KiB pages and 28.3 GB/s on 2 MiB pages, a plain sum 23.3
and 31.8 GB/s. The kernel backs memory with huge pages on first touch only where madvise asked
for them (`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on Debian), so the arena is
allocated untouched, advised, then written.

One arena per model (per TP rank), the tensors in module order, which is the order a forward
reads them: the step is one sequential stream. Parameters keep their Parameter objects (tied
weights stay tied); only `.data` moves. oneDNN-packed (mkldnn) weights are opaque and stay where
oneDNN put them.

`KVPIPE_HUGE_PAGES=0` keeps torch's own allocations (for A/B benchmarks); elsewhere than Linux,
or where madvise refuses, the arena is ordinary memory and nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line (and on every dtype's alignment)


def huge_pages_enabled() -> bool:
    on = os.environ.get("KVPIPE_HUGE_PAGES", "1") != "0"
    return on and sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE")


def _madvise_huge(addr: int, length: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), mmap.MADV_HUGEPAGE) == 0:
        return True
    logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return False


def arena(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], untouched, starting on a 2 MiB boundary and advised for huge pages (the
    whole 2 MiB pages it spans). torch.empty of this size is a fresh anonymous mapping."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    _madvise_huge(raw.data_ptr() + start, (nbytes + HUGE_PAGE - start) // HUGE_PAGE * HUGE_PAGE)
    return raw[start : start + nbytes]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def relocate(
    tensors: Sequence[torch.Tensor], moved: Callable[[int, torch.Tensor], None] | None = None
) -> list[torch.Tensor]:
    """Copies of `tensors` (dense CPU) packed into one huge-page arena, in this order; each copy is
    contiguous with the original's shape, dtype and values. `moved(i, copy)` runs as each copy is
    made, and `tensors[i]` is read only when it is copied: a caller that drops its references to
    original i there (its list entry too) has it freed before the next one is copied, so the peak
    holds the arena and one original, not the arena and every original (a model's weights twice)."""
    sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
    if not tensors:
        return []
    buf = arena(sum(sizes))
    out, off = [], 0
    for i, size in enumerate(sizes):
        t = tensors[i]
        view = buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        del t
        out.append(view)
        if moved is not None:
            moved(i, view)
        off += size
    return out


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout is torch.strided and not t.is_mkldnn and t.numel() > 0


Slot = tuple[nn.Module, str, bool]  # (module, name, is_parameter)


def _weights(model: nn.Module) -> tuple[list[torch.Tensor], dict[int, list[Slot]]]:
    """The movable tensors of `model` in module order, each once, and where each one is used."""
    slots: dict[int, list[Slot]] = {}
    first: dict[tuple[int, torch.dtype, tuple[int, ...]], int] = {}  # a tensor's identity -> its index
    tensors: list[torch.Tensor] = []
    for mod in model.modules():
        for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in store.items():
                if t is None or not _movable(t):
                    continue
                key = (t.data_ptr(), t.dtype, tuple(t.shape))
                if key not in first:
                    first[key] = len(tensors)
                    tensors.append(t.detach())
                slots.setdefault(first[key], []).append((mod, name, is_param))
    return tensors, slots


def place_weights(model: nn.Module) -> int:
    """Move every dense CPU parameter and buffer of `model` into one huge-page arena (module
    order; a tensor shared by several modules once); returns the bytes moved. No-op when
    huge_pages_enabled() is False."""
    if not huge_pages_enabled():
        return 0
    tensors, slots = _weights(model)

    def swap(i: int, copy: torch.Tensor) -> None:  # every user of tensor i now holds its copy
        tensors[i] = copy
        for mod, name, is_param in slots[i]:
            if is_param:
                mod._parameters[name].data = copy  # type: ignore[union-attr]
            else:
                mod._buffers[name] = copy

    with torch.no_grad():
        moved = relocate(tensors, swap)
    nbytes = sum(t.numel() * t.element_size() for t in moved)
    logger.debug("%d tensors (%.1f MB) in huge pages", len(moved), nbytes / 1e6)
    return nbytes
