"""Which pages a request of `kvpipe bench transfer` moves, and its write ops (pure numpy).

The decode's pages come in runs as fragmented as asked (`fragmented_pages`); a sliding-window
shape (GPT-OSS) adds both sides' window tables, the decode's taken apart from its full pages
as its scheduler reserves them; `plan_request` plans the request as PD does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpipe.bench.transfer.config import WorkerConfig
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.op_arrays import OpArrays
from kvpipe.transfer.planning.planner import TransferPlan, plan_pages
from kvpipe.transfer.planning.window_table import window_pages_problem


def fragmented_pages(n: int, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """n destination page ids in runs: each page starts a new run with probability `fraction`.

    Runs are placed in random order with a one-page gap, so no two runs merge; ids < 2n.
    """
    if fraction <= 0 or n == 0:
        return np.arange(n, dtype=np.int64)
    starts = rng.random(n) < fraction
    starts[0] = True
    run_id = np.cumsum(starts) - 1
    run_len = np.bincount(run_id)
    order = rng.permutation(run_len.size)
    placed = np.concatenate(([0], np.cumsum(run_len[order] + 1)[:-1]))
    run_start = np.empty_like(placed)
    run_start[order] = placed
    first_index = np.flatnonzero(starts)
    return (run_start[run_id] + np.arange(n) - first_index[run_id]).astype(np.int64)


def source_window_table(prompt_len: int, cfg: WorkerConfig) -> np.ndarray | None:
    """The prefill's window table of a request whose full pages are [0, n): logical pages
    [first, n) on pages max_pages + [0, n - first), -1 before; None without sliding layers."""
    if not cfg.sliding_layers:
        return None
    first, end = cfg.window_pages(prompt_len)
    table = np.full(end, -1, dtype=np.int64)
    table[first:] = cfg.max_pages + np.arange(end - first)
    return table


def decode_window_table(
    prompt_len: int, cfg: WorkerConfig, full: np.ndarray, rng: np.random.Generator
) -> np.ndarray | None:
    """The decode's window table, as its scheduler reserves one (window_first_page): aligned
    with its full table `full`, pages for the prompt's last window only (-1 before), taken past
    the full pages' region (so never one of them: the pools alias) in runs as fragmented as the
    full pages; None without sliding layers."""
    if not cfg.sliding_layers:
        return None
    first, end = cfg.window_pages(prompt_len)
    table = np.full(end, -1, dtype=np.int64)
    table[first:] = cfg.full_region + fragmented_pages(end - first, cfg.fragmentation, rng)
    if (why := window_pages_problem(table, cfg.pool_pages, full, exact=True, aliased=True)) is not None:
        raise AssertionError(why)
    return table


@dataclass(frozen=True, eq=False)
class RequestPages:
    """One request's pages on both sides: full tables, and (sliding shapes) window tables."""

    src: np.ndarray
    dst: np.ndarray
    src_swa: np.ndarray | None = None
    dst_swa: np.ndarray | None = None


def joined_ops(parts: Sequence[OpArrays]) -> OpArrays:
    """The ops of `parts` one after the other (one batch)."""
    return OpArrays(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("src_addr", "dst_addr", "length")))


@dataclass(frozen=True, eq=False)
class RequestPlan(OpArrays):
    """A request's KV ops: one plan of every layer, or (sliding shapes) the full layers' plan
    over every page then the sliding layers' plan over the window pages, arrays concatenated."""

    parts: tuple[TransferPlan, ...]
    planning_ms: float

    @property
    def num_runs(self) -> int:  # the full layers' runs (ops per buffer)
        return self.parts[0].num_runs


def plan_request(pages: RequestPages, src: KVLayout, dst: KVLayout) -> RequestPlan:
    """Plan a request as sender_room._plan_kv does on its last call: every page of the full
    layers, and the sliding layers (layout.swa_layers) at the positions dst_swa asks for (>= 0)."""
    if not src.swa_layers:
        p = plan_pages(pages.src, pages.dst, src, dst)
        return RequestPlan(p.src_addr, p.dst_addr, p.length, parts=(p,), planning_ms=p.planning_ms)
    src_swa, dst_swa = pages.src_swa, pages.dst_swa
    if src_swa is None or dst_swa is None:
        raise ValueError("a sliding-window layout needs both window tables")
    t0 = time.perf_counter()
    swa = np.asarray(src.swa_mask, dtype=bool)
    ids = np.arange(src.num_layers)
    pos = np.flatnonzero(dst_swa >= 0)  # logical pages the decode wants for its sliding layers
    if pos.size and (pos[-1] >= src_swa.size or (src_swa[pos] < 0).any()):
        raise ValueError("the prefill holds no window page for a logical page the decode asked for")
    parts = (
        plan_pages(pages.src, pages.dst, src, dst, layer_ids=ids[~swa]),
        plan_pages(src_swa[pos], dst_swa[pos], src, dst, layer_ids=ids[swa]),
    )
    ops = joined_ops(parts)
    planning_ms = (time.perf_counter() - t0) * 1e3
    return RequestPlan(ops.src_addr, ops.dst_addr, ops.length, parts=parts, planning_ms=planning_ms)
