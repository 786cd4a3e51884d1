"""The prefill process of `kvpipe bench transfer` (same TP): per prompt length, writes a request's
KV into the decode's pool and times it against raw Mooncake transfers of the same bytes (the
order of the steps: procs.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from kvpipe.bench.rotation import rotated
from kvpipe.bench.transfer.config import WorkerConfig
from kvpipe.bench.transfer.messages import DecodePool, DigestPages, PagesDigest, PoolZeroed, ZeroPool
from kvpipe.bench.transfer.pages import (
    RequestPages,
    RequestPlan,
    decode_window_table,
    fragmented_pages,
    joined_ops,
    plan_request,
    source_window_table,
)
from kvpipe.bench.transfer.process_pair import Peer
from kvpipe.bench.transfer.procs import DST_STATE_SLOT, SRC_STATE_SLOT, Pools, digest, setup, state_buffers
from kvpipe.bench.transfer.raw_mooncake import WHOLE, RawPattern, pattern_ops, raw_write
from kvpipe.transfer.backends.base import BatchHandle, BatchState
from kvpipe.transfer.control.messages import RegisterPeer, decode
from kvpipe.transfer.recurrent.plan import StatePlan, plan_state

ONE_OP = RawPattern(WHOLE, 1)


@dataclass(frozen=True, eq=False)
class Write:
    """One timed kvpipe write of a request: wall time (planning included), its plans, its batch."""

    seconds: float
    kv: RequestPlan
    state: StatePlan | None
    planning_ms: float
    handle: BatchHandle


class Writer:
    """Writes into the decode's pool: kvpipe's plans through the backend, or raw patterns."""

    def __init__(self, side: Pools, reg: RegisterPeer, raw_dst: int) -> None:
        src_layout = side.layout
        if (why := src_layout.compatible_with(reg.layout)) is not None:
            raise RuntimeError(f"decode pool incompatible: {why}")
        if (side.state_layout is None) != (reg.state is None):
            raise RuntimeError("one side has a state pool, the other not")
        self.side, self.reg, self.raw_dst, self.src_layout = side, reg, raw_dst, src_layout

    def kv_write(self, pages: RequestPages, max_op_bytes: int | None) -> Write:
        """Planning plus the transfer until every piece landed; a hybrid request's state ops go in
        the same batch as its KV ops."""
        backend, src_state, dst_state = self.side.backend, self.side.state_layout, self.reg.state
        backend.max_op_bytes = max_op_bytes
        t0 = time.perf_counter()
        kv = plan_request(pages, self.src_layout, self.reg.layout)
        t1 = time.perf_counter()
        st = None
        if src_state is not None and dst_state is not None:
            st = plan_state(SRC_STATE_SLOT, DST_STATE_SLOT, src_state, dst_state)
        planning_ms = kv.planning_ms + (time.perf_counter() - t1) * 1e3
        ops = kv if st is None else joined_ops([kv, st])
        h = backend.submit(self.reg.data_address, ops.src_addr, ops.dst_addr, ops.length)
        if backend.wait(h, time.monotonic() + 300) is not BatchState.DONE:
            raise RuntimeError(f"transfer failed: {h.error or 'timed out'}")
        return Write(time.perf_counter() - t0, kv, st, planning_ms, h)

    def kv_seconds(self, pages: RequestPages, max_op_bytes: int | None) -> float:
        return self.kv_write(pages, max_op_bytes).seconds

    def raw_seconds(self, pattern: RawPattern, nbytes: int) -> float:
        """Wall time of the raw pattern; its pieces are cut before the clock starts."""
        ops = pattern_ops(self.side.raw.ctypes.data, self.raw_dst, nbytes, pattern)
        t0 = time.perf_counter()
        raw_write(self.side.backend.engine, self.reg.data_address, *ops, pattern.window)
        return time.perf_counter() - t0


def _timed_rounds(variants: dict[Any, Callable[[], float]], repeat: int) -> dict[Any, list[float]]:
    """Each variant once per round, the rounds' orders rotated: seconds per variant."""
    times: dict[Any, list[float]] = {v: [] for v in variants}
    for r in range(repeat):
        for v in rotated(list(variants), r):
            times[v].append(variants[v]())
    return times


def _length(cfg: WorkerConfig, peer: Peer, w: Writer, n_tokens: int, rng: np.random.Generator) -> dict[str, Any]:
    """The figures of one prompt length (see the module doc of procs.py)."""
    layout, side = w.src_layout, w.side
    n = -(-n_tokens // cfg.page_size)
    all_pages_bytes = n * layout.page_nbytes * layout.num_buffers  # every page of every layer
    first_w, _ = cfg.window_pages(n_tokens)
    # full layers every page, sliding layers (if any) the window's n - first_w pages
    n_swa = len(cfg.sliding_layers)
    kv_bytes = ((cfg.num_layers - n_swa) * n + n_swa * (n - first_w)) * layout.page_nbytes * layout.buffers_per_layer
    state_bytes = 0 if side.state is None else side.state.slot_nbytes
    nbytes = kv_bytes + state_bytes  # the raw patterns move the same total
    src_pages = np.arange(n, dtype=np.int64)
    dst_pages = fragmented_pages(n, cfg.fragmentation, rng)
    pages = RequestPages(
        src_pages, dst_pages, source_window_table(n_tokens, cfg), decode_window_table(n_tokens, cfg, dst_pages, rng)
    )
    peer.ask(ZeroPool(), PoolZeroed)
    writes = [w.kv_write(pages, cfg.max_op_bytes)]  # warms the connection
    if writes[0].kv.nbytes != kv_bytes:
        raise RuntimeError(f"planned {writes[0].kv.nbytes} KV bytes, expected {kv_bytes}")
    landed = peer.ask(DigestPages(pages.dst, pages.dst_swa), PagesDigest).hexdigest
    verified = landed == digest(side.pool, pages.src, side.state, SRC_STATE_SLOT, pages.src_swa)

    raw: dict[Any, Callable[[], float]] = {p: partial(w.raw_seconds, p, nbytes) for p in (ONE_OP, *cfg.raw_patterns)}
    sweep = {p: statistics.median(xs) for p, xs in _timed_rounds(raw, cfg.repeat).items()}
    best = min(sweep, key=sweep.__getitem__)

    def kv_timed() -> float:
        writes.append(w.kv_write(pages, cfg.max_op_bytes))
        return writes[-1].seconds

    variants: dict[Any, Callable[[], float]] = {
        "kv": kv_timed,
        "raw": raw[ONE_OP],
        "best_raw": partial(w.raw_seconds, best, nbytes),
    }
    for m in cfg.compare_max_op_bytes:
        variants[f"kv_split_{m}"] = partial(w.kv_seconds, pages, m or None)
    times = _timed_rounds(variants, cfg.repeat)
    side.backend.max_op_bytes = cfg.max_op_bytes
    med = {v: statistics.median(xs) for v, xs in times.items()}
    last, kv = writes[-1], med["kv"]
    state_ops = 0 if last.state is None else last.state.num_ops
    return {
        "prompt_len": n_tokens,
        "pages": n,
        "bytes": nbytes,
        "kv_bytes": kv_bytes,
        "state_bytes": state_bytes,
        # a sliding shape's window pages, and its KV against a bench of every page
        "window_pages": n - first_w,
        "all_pages_bytes": all_pages_bytes,
        "window_ratio": kv_bytes / all_pages_bytes,
        "ops_per_request": last.kv.num_ops + state_ops,
        "kv_ops": last.kv.num_ops,
        "state_ops": state_ops,
        "pieces_per_request": last.handle.num_pieces,
        "runs": last.kv.num_runs,
        "planning_ms": statistics.median(x.planning_ms for x in writes),
        "transfer_ms": kv * 1e3,
        "raw_ms": med["raw"] * 1e3,
        "best_raw_ms": med["best_raw"] * 1e3,
        "goodput_gbps": nbytes / kv / 1e9,
        "raw_goodput_gbps": nbytes / med["raw"] / 1e9,
        "best_raw_goodput_gbps": nbytes / med["best_raw"] / 1e9,
        "unsplit_goodput_gbps": nbytes / med["kv_split_0"] / 1e9 if "kv_split_0" in med else None,
        "split_compare": [
            {
                "max_op_bytes": m,
                "ms": med[f"kv_split_{m}"] * 1e3,
                "goodput_gbps": nbytes / med[f"kv_split_{m}"] / 1e9,
            }
            for m in cfg.compare_max_op_bytes
        ],
        "goodput_ratio": med["raw"] / kv,
        "best_raw_ratio": med["best_raw"] / kv,
        # median over repeats of best-raw time / kvpipe time in the same round: drift on a
        # shared machine moves both, so this is steadier than the ratio of medians
        "best_raw_ratio_paired": statistics.median(b / k for b, k in zip(times["best_raw"], times["kv"])),
        "best_raw": {"piece_bytes": best.piece_bytes, "window": best.window, "label": best.label},
        "sweep": [
            {"piece_bytes": p.piece_bytes, "window": p.window, "ms": s * 1e3, "goodput_gbps": nbytes / s / 1e9}
            for p, s in sweep.items()
        ],
        "verified": verified,
        **{f"{v}_ms_all": [x * 1e3 for x in xs] for v, xs in times.items()},
    }


def prefill_main(cfg: WorkerConfig, peer: Peer) -> dict[str, Any]:
    """Sender: for each prompt length, moves a request's KV `repeat` times, plus raw transfers."""
    side = setup(cfg, cfg.prefill_pages)
    try:
        g = torch.Generator().manual_seed(cfg.seed)
        for buf in list({id(b): b for b in side.pool.buffers()}.values()) + state_buffers(side.state):  # aliased once
            buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
        hello = peer.expect(DecodePool)
        reg = decode(hello.registration)
        if not isinstance(reg, RegisterPeer):
            raise RuntimeError(f"the decode registered with a {type(reg).__name__}")
        w = Writer(side, reg, hello.raw_address)
        rng = np.random.default_rng(cfg.seed)
        lengths = [_length(cfg, peer, w, n_tokens, rng) for n_tokens in cfg.prompt_lens]
        return {"lengths": lengths, "engine_generation": side.backend.generation}
    finally:
        side.backend.close()
