"""Pages -> coalesced (src_addr, dst_addr, length) write ops, vectorised with numpy.

Same heads on both sides: the (src page, dst page) pairs split wherever either side is not
consecutive; each contiguous run is one op per (layer, K/V) buffer: ops = layers * 2 * runs
(layers * runs for an MLA latent: one buffer per layer, never head-sliced).
Different head ranges (heterogeneous TP): the moved head range of one page is contiguous on each
side but pages are not, so one op per (layer, K/V, page); when the range covers whole pages on
both sides it is the same-heads case again and runs coalesce.

Op order is buffer-major (layer l K, layer l V, layer l+1 K, ...) then run, so the ops of a
layer range are one contiguous slice of the arrays: layer-pipelined transfer ships
`plan.layers(a, b)` per layer group without replanning.

An explicit, increasing set of layers (`layer_ids`: the full or the sliding-window layers of a
model whose layers alternate) plans the same way over those layers' buffers only, in one call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.op_arrays import OpArrays
from kvpipe.transfer.planning.tp_mapping import head_intersection


@dataclass(frozen=True, eq=False)
class TransferPlan(OpArrays):
    layer_start: int  # the plan covers layers [layer_start, layer_end)
    layer_end: int
    num_runs: int  # ops per buffer: contiguous page runs (or pages, when heads are sliced)
    num_pages: int
    head_start: int  # global KV heads moved: [head_start, head_end)
    head_end: int
    planning_ms: float
    buffers_per_layer: int = 2  # K and V, or 1: the MLA latent
    layer_ids: np.ndarray | None = None  # [n] increasing layers planned; None: all of [layer_start, layer_end)

    @property
    def ops_per_layer(self) -> int:
        return self.buffers_per_layer * self.num_runs

    def layers(self, start: int, end: int) -> TransferPlan:
        """The sub-plan of layers [start, end): array views, no replanning."""
        if not self.layer_start <= start <= end <= self.layer_end:
            raise ValueError(f"layers [{start}, {end}) outside the plan's [{self.layer_start}, {self.layer_end})")
        ids = None
        if self.layer_ids is None:
            i, j = start - self.layer_start, end - self.layer_start
        else:  # the planned layers inside [start, end): one contiguous slice of the ids
            i, j = np.searchsorted(self.layer_ids, (start, end))
            ids = self.layer_ids[i:j]
        a, b = i * self.ops_per_layer, j * self.ops_per_layer
        return TransferPlan(
            self.src_addr[a:b],
            self.dst_addr[a:b],
            self.length[a:b],
            start,
            end,
            self.num_runs,
            self.num_pages,
            self.head_start,
            self.head_end,
            0.0,
            self.buffers_per_layer,
            ids,
        )


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split page pairs into maximal runs consecutive on both sides: (src_first, dst_first, length)."""
    n = src_pages.size
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    return src_pages[starts], dst_pages[starts], lengths


def _check_pages(pages: np.ndarray, layout: KVLayout, side: str) -> None:
    if pages.size and (pages.min() < 0 or pages.max() >= layout.num_pages):
        raise ValueError(f"{side} page ids outside [0, {layout.num_pages}): min {pages.min()}, max {pages.max()}")


def plan_pages(
    src_pages: np.ndarray | list[int],
    dst_pages: np.ndarray | list[int],
    src: KVLayout,
    dst: KVLayout,
    *,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
    layer_ids: np.ndarray | list[int] | None = None,
) -> TransferPlan:
    """Plan writing source pages `src_pages[i]` into destination pages `dst_pages[i]`.

    heads: global KV heads to move (default: the intersection of both ranks' ranges).
    layers: [start, end) to plan (default: all).
    layer_ids: instead of `layers`, an increasing array of the layers to plan (ops in its order).
    """
    t0 = time.perf_counter()
    reason = src.compatible_with(dst)
    if reason is not None:
        raise ValueError(f"incompatible KV layouts: {reason}")
    s = np.asarray(src_pages, dtype=np.int64).ravel()
    d = np.asarray(dst_pages, dtype=np.int64).ravel()
    if s.shape != d.shape:
        raise ValueError(f"{s.size} source pages vs {d.size} destination pages")
    _check_pages(s, src, "source")
    _check_pages(d, dst, "destination")
    if d.size > 1 and not (np.diff(d) > 0).all() and (np.diff(np.sort(d)) == 0).any():  # sort only if unordered
        raise ValueError("duplicate destination pages: two source pages would land in one")

    common = head_intersection((src.head_start, src.head_end), (dst.head_start, dst.head_end))
    if heads is None:
        if common is None:
            raise ValueError(
                f"no common KV heads: source [{src.head_start}, {src.head_end}), "
                f"destination [{dst.head_start}, {dst.head_end})"
            )
        heads = common
    elif common is None or not (common[0] <= heads[0] < heads[1] <= common[1]):
        raise ValueError(f"heads {heads} not held by both sides (common: {common})")
    ids = None
    if layer_ids is not None:
        if layers is not None:
            raise ValueError("give layers or layer_ids, not both")
        ids = np.asarray(layer_ids, dtype=np.int64).ravel()
        if ids.size and (ids[0] < 0 or ids[-1] >= src.num_layers or (np.diff(ids) <= 0).any()):
            raise ValueError(f"layer ids must increase inside [0, {src.num_layers}): {ids.tolist()}")
        l0, l1 = (int(ids[0]), int(ids[-1]) + 1) if ids.size else (0, 0)
    else:
        l0, l1 = layers if layers is not None else (0, src.num_layers)
        if not 0 <= l0 <= l1 <= src.num_layers:
            raise ValueError(f"layers [{l0}, {l1}) outside [0, {src.num_layers})")

    h0, h1 = heads
    slice_nbytes = (h1 - h0) * src.head_nbytes  # head_nbytes is equal on both sides (compatible)
    whole_pages = h1 - h0 == src.kv_heads == dst.kv_heads
    if whole_pages:
        run_src, run_dst, run_len = page_runs(s, d)
    else:  # a head slice of consecutive pages is strided: one op per page
        run_src, run_dst, run_len = s, d, np.ones_like(s)
    # Offsets inside one buffer, [R]; bases of the planned buffers, [B]; ops = [B, R] flattened.
    src_rel = run_src * src.page_nbytes + (h0 - src.head_start) * src.head_nbytes
    dst_rel = run_dst * dst.page_nbytes + (h0 - dst.head_start) * dst.head_nbytes
    per = src.buffers_per_layer  # equal on both sides (compatible)
    # buffer indices planned, [B] layer-major: K then V (or the latent) of each layer
    bufs = np.arange(per * l0, per * l1) if ids is None else (per * ids[:, None] + np.arange(per)).ravel()
    src_base = np.asarray(src.buffer_addrs, dtype=np.int64)[bufs]
    dst_base = np.asarray(dst.buffer_addrs, dtype=np.int64)[bufs]
    src_addr = (src_base[:, None] + src_rel[None, :]).ravel()
    dst_addr = (dst_base[:, None] + dst_rel[None, :]).ravel()
    length = np.tile(run_len * slice_nbytes, src_base.size)
    ms = (time.perf_counter() - t0) * 1e3
    return TransferPlan(src_addr, dst_addr, length, l0, l1, int(run_len.size), int(s.size), h0, h1, ms, per, ids)


@dataclass(frozen=True)
class PageSpan:
    """Pages [first, end) of a request's page table that can be sent now."""

    first: int
    end: int
    token_end: int  # the request's send cursor (tokens) once this span is sent

    @property
    def num_pages(self) -> int:
        return max(0, self.end - self.first)


def sendable_pages(sent_tokens: int, ready_tokens: int, page_size: int, final: bool) -> PageSpan:
    """Incremental (chunked) transfer: which pages to send when KV of `ready_tokens` tokens exists.

    `sent_tokens` (the cursor, or the prefix decode already holds) is page aligned: a trailing
    partial page waits for the next chunk unless this is the final chunk, so a page is never
    sent while tokens may still be appended to it.
    """
    if sent_tokens % page_size:
        raise ValueError(f"send cursor {sent_tokens} is not a multiple of page size {page_size}")
    if not 0 <= sent_tokens <= ready_tokens:
        raise ValueError(f"send cursor {sent_tokens} beyond ready tokens {ready_tokens}")
    first = sent_tokens // page_size
    if final:
        return PageSpan(first, -(-ready_tokens // page_size), ready_tokens)
    end = ready_tokens // page_size
    return PageSpan(first, end, end * page_size)


# Cost model of a staged chunk against its page ops (staging/buffers.py). A Mooncake TCP op costs about
# OP_COST_S of fixed work (docs/benchmarks.md, fragmentation sweep); a staged chunk costs a slot
# round trip and an announce/done round trip on the control plane (STAGING_FIXED_S) plus a
# gather and a scatter of its bytes at memory speed (MEMCPY_BYTES_PER_S), and one op.
OP_COST_S = 11e-6
STAGING_FIXED_S = 400e-6
MEMCPY_BYTES_PER_S = 4e9


def staging_pays(num_ops: int, op_nbytes: int) -> bool:
    """True when writing `num_ops` ops of `op_nbytes` each costs more than staging them as one chunk."""
    plain = num_ops * OP_COST_S
    staged = OP_COST_S + STAGING_FIXED_S + 2 * num_ops * op_nbytes / MEMCPY_BYTES_PER_S
    return plain > staged
