"""Bookkeeping of the transfer benchmark (no processes, no timing): fragmented page layouts, flags,
raw patterns, the report table."""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing

import numpy as np
import pytest
import torch

from kvpipe.bench.transfer.command import RAW_PIECES, RAW_WINDOWS, add_args, config_from_args, tp_config_from_args
from kvpipe.bench.transfer.messages import DigestPages, PagesDigest, PoolZeroed, ProtocolError
from kvpipe.bench.transfer.pages import (
    RequestPages,
    decode_window_table,
    fragmented_pages,
    plan_request,
    source_window_table,
)
from kvpipe.bench.transfer.process_pair import Peer
from kvpipe.bench.transfer.procs import digest
from kvpipe.bench.transfer.raw_mooncake import WHOLE, RawPattern, fmt_bytes, parse_bytes, pattern_ops
from kvpipe.bench.transfer.report import format_table, summarize
from kvpipe.bench.transfer.shapes import EXTRA_SHAPES, lookup_shape
from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool
from kvpipe.config import ParallelConfig
from kvpipe.model.layers.gated_delta_net import local_state_shape
from kvpipe.transfer.backends.mooncake import DEFAULT_MAX_OP_BYTES
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.planner import page_runs


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 1.0])
def test_fragmented_pages_have_the_requested_runs(fraction):
    rng = np.random.default_rng(1)
    n = 500
    pages = fragmented_pages(n, fraction, rng)
    assert pages.size == n and np.unique(pages).size == n
    assert pages.min() >= 0 and pages.max() < 2 * n
    _, _, runs = page_runs(np.arange(n), pages)
    if fraction == 0.0:
        assert runs.size == 1 and (pages == np.arange(n)).all()
    elif fraction == 1.0:
        assert runs.size == n
    else:
        assert abs(runs.size - fraction * n) < 4 * np.sqrt(n)


def test_flags_to_worker_config():
    p = argparse.ArgumentParser()
    add_args(p)
    cfg = config_from_args(
        p.parse_args(["--preset", "bench", "--prompt-lens", "100,33", "--page-size", "16", "--layers", "3"]),
        "/tmp/x.log",
    )
    assert (cfg.num_layers, cfg.kv_heads, cfg.head_dim, cfg.dtype) == (3, 4, 64, "float32")
    assert cfg.prompt_lens == (100, 33) and cfg.max_pages == 7 and cfg.pool_pages == 7
    cfg = config_from_args(p.parse_args(["--preset", "llama3-8b", "--fragmentation", "0.5"]), "/tmp/x.log")
    assert cfg.dtype == "bfloat16" and cfg.pool_pages == 2 * cfg.max_pages
    for bad in (["--prompt-lens", "0"], ["--fragmentation", "2"], ["--preset", "nope"]):
        with pytest.raises(SystemExit):
            config_from_args(p.parse_args(bad), "/tmp/x.log")


@pytest.mark.parametrize("kv,itemsize", [("bfloat16", 2), ("float16", 2), ("fp8_e4m3", 1), ("fp8_e5m2", 1)])
def test_kv_cache_dtype_shrinks_the_bytes_by_the_itemsize_ratio(kv, itemsize):
    """--kv-cache-dtype: the pools are made of that dtype; the bench's prediction (KVShape) and
    the planner's plan of a request both shrink by exactly itemsize / 4 against fp32 KV, and a
    copy along the plan lands every byte of the request's pages (1-byte elements included)."""
    p = argparse.ArgumentParser()
    add_args(p)
    base = ["--preset", "tiny", "--prompt-lens", "100", "--page-size", "16"]
    fp32 = config_from_args(p.parse_args(base), "/tmp/x.log")
    cfg = config_from_args(p.parse_args([*base, "--kv-cache-dtype", kv]), "/tmp/x.log")
    assert fp32.dtype == "float32" and getattr(torch, cfg.dtype).itemsize == itemsize
    shape32, shape = lookup_shape("tiny"), _shape_of(cfg)
    assert shape32 is not None and shape.request_kv_nbytes(100, 16) * 4 == shape32.request_kv_nbytes(100, 16) * itemsize
    plans = {}
    for c in (fp32, cfg):
        src, dst = (KVPool(c.num_layers, 8, 16, c.kv_heads, c.head_dim, getattr(torch, c.dtype)) for _ in range(2))
        for t in src.buffers():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t.dtype))
        pages = RequestPages(np.arange(7), np.array([7, 6, 0, 1, 2, 4, 5]))
        plans[c.dtype] = plan = plan_request(pages, KVLayout.from_pool(src), KVLayout.from_pool(dst))
        for s_, d_, n_ in zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.length.tolist()):
            ctypes.memmove(d_, s_, n_)
        assert digest(dst, pages.dst) == digest(src, pages.src)
    assert plans[cfg.dtype].nbytes == shape.request_kv_nbytes(100, 16)
    assert plans[cfg.dtype].nbytes * 4 == plans["float32"].nbytes * itemsize
    assert plans[cfg.dtype].num_ops == plans["float32"].num_ops  # the same runs, shorter
    with pytest.raises(SystemExit, match="KV-only"):
        config_from_args(p.parse_args(["--preset", "tiny-qwen3.5", "--kv-cache-dtype", kv]), "/tmp/x.log")


def _shape_of(cfg):
    from kvpipe.bench.transfer.shapes import KVShape

    return KVShape(cfg.num_layers, cfg.kv_heads, cfg.head_dim, cfg.dtype)


def test_mla_shape_is_a_latent_pool_and_not_a_tp_bench():
    p = argparse.ArgumentParser()
    add_args(p)
    cfg = config_from_args(p.parse_args(["--preset", "deepseek-v3"]), "/tmp/x.log")
    assert cfg.latent and (cfg.num_layers, cfg.kv_heads, cfg.head_dim, cfg.dtype) == (61, 1, 576, "bfloat16")
    with pytest.raises(SystemExit, match="one KV head"):
        config_from_args(p.parse_args(["--preset", "deepseek-v3", "--kv-heads", "2"]), "/tmp/x.log")
    with pytest.raises(SystemExit, match="never sliced"):
        tp_config_from_args(p.parse_args(["--preset", "deepseek-v3", "--decode-tp", "2"]), "/tmp/x.log", "127.0.0.1")
    assert not config_from_args(p.parse_args(["--preset", "tiny"]), "/tmp/x.log").latent


def test_piece_flags_and_raw_patterns():
    p = argparse.ArgumentParser()
    add_args(p)
    cfg = config_from_args(p.parse_args([]), "/tmp/x.log")
    assert cfg.max_op_bytes == DEFAULT_MAX_OP_BYTES and cfg.compare_max_op_bytes == (0,)
    assert set(cfg.raw_patterns) == {RawPattern(a, w) for a in RAW_PIECES for w in RAW_WINDOWS}
    cfg = config_from_args(
        p.parse_args(
            ["--max-op-bytes", "0", "--raw-pieces", "64K,3M", "--raw-windows", "8", "--compare-split", "0,1MiB"]
        ),
        "/tmp/x.log",
    )
    assert cfg.max_op_bytes is None and cfg.compare_max_op_bytes == (0, 1 << 20)
    assert cfg.raw_patterns == (RawPattern(64 << 10, 8), RawPattern(3 << 20, 8))
    cfg = config_from_args(p.parse_args(["--raw-sweep"]), "/tmp/x.log")
    assert len(cfg.raw_patterns) == 9 * 6 and min(x.piece_bytes for x in cfg.raw_patterns) == 64 << 10
    for bad in (
        ["--raw-windows", "0"],
        ["--raw-windows", "2048"],
        ["--raw-pieces", "0"],
        ["--raw-pieces", "x"],
        ["--max-op-bytes", "-1"],
        ["--max-op-bytes", "1,2"],
        ["--compare-split", ""],
    ):
        with pytest.raises(SystemExit):
            config_from_args(p.parse_args(bad), "/tmp/x.log")


def test_bytes_and_pattern_ops():
    assert [parse_bytes(x) for x in ("64K", "1M", "1MiB", "2g", "4096", " 8M ")] == [
        65536,
        1 << 20,
        1 << 20,
        2 << 30,
        4096,
        8 << 20,
    ]
    assert [fmt_bytes(x) for x in (65536, 1 << 20, 3 << 20, 1000)] == ["64K", "1M", "3M", "1000"]
    s, d, n = pattern_ops(1000, 5000, 10 << 20, RawPattern(4 << 20, 16))
    assert n.tolist() == [4 << 20, 4 << 20, 2 << 20] and (d - s == 4000).all()
    s, d, n = pattern_ops(1000, 5000, 10 << 20, RawPattern(WHOLE, 1))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([1000], [5000], [10 << 20]) and RawPattern(WHOLE, 1).label == "1 op"


def test_table_shows_ops_pieces_best_raw_and_the_sweep():
    p = argparse.ArgumentParser()
    add_args(p)
    cfg = config_from_args(p.parse_args(["--prompt-lens", "1024", "--compare-split", "0,1M"]), "/tmp/x.log")
    sweep = [
        {"piece_bytes": WHOLE, "window": 1, "ms": 12.0, "goodput_gbps": 2.0},
        {"piece_bytes": 1 << 20, "window": 16, "ms": 10.0, "goodput_gbps": 2.4},
    ]
    length = {
        "prompt_len": 1024,
        "pages": 64,
        "bytes": 24 << 20,
        "ops_per_request": 24,
        "pieces_per_request": 24,
        "runs": 1,
        "planning_ms": 0.3,
        "transfer_ms": 11.0,
        "raw_ms": 12.0,
        "best_raw_ms": 10.0,
        "goodput_gbps": 2.2,
        "unsplit_goodput_gbps": 2.1,
        "raw_goodput_gbps": 2.0,
        "best_raw_goodput_gbps": 2.4,
        "goodput_ratio": 12 / 11,
        "best_raw_ratio": 10 / 11,
        "best_raw_ratio_paired": 0.93,
        "best_raw": {"piece_bytes": 1 << 20, "window": 16, "label": "1M x w16"},
        "sweep": sweep,
        "split_compare": [
            {"max_op_bytes": 0, "ms": 12.0, "goodput_gbps": 2.1},
            {"max_op_bytes": 1 << 20, "ms": 11.0, "goodput_gbps": 2.2},
        ],
        "verified": True,
    }
    report = summarize({"lengths": [length], "engine_generation": 0}, cfg, None)
    assert report["best_raw_ratio"] == pytest.approx(10 / 11) and report["pieces_per_request"] == 24
    table = format_table(report, sweep=True)
    assert (
        "1M x w16" in table
        and "0.91" in table
        and "0.93" in table
        and "split at (GB/s), 1024 tokens: off 2.10, 1M 2.20" in table
    )
    assert "one op: 2.00; best: 1M x w16" in table and "2.40" in table.splitlines()[-1]


def test_hybrid_shapes_move_full_attention_kv_and_a_state_slot():
    p = argparse.ArgumentParser()
    add_args(p)
    cfg = config_from_args(p.parse_args(["--preset", "tiny-qwen3.5"]), "/tmp/x.log")
    assert cfg.hybrid is not None and cfg.hybrid.full_layers == (3,) and cfg.hybrid.linear_layers == (0, 1, 2)
    assert (cfg.num_layers, cfg.kv_heads, cfg.head_dim, cfg.dtype) == (1, 2, 32, "float32")  # KV: layer 3 only
    real = EXTRA_SHAPES["qwen3.5"]
    assert (real.num_layers, real.kv_heads, real.head_dim, real.dtype) == (8, 4, 256, "bfloat16")
    assert real.hybrid is not None and real.hybrid.full_layers == (3, 7, 11, 15, 19, 23, 27, 31)
    assert real.kv_token_nbytes == 8 * 2 * 4 * 256 * 2
    # the shape's state bytes are what the workers' StatePool holds per slot
    pool = StatePool(real.hybrid.linear_layers, 1, local_state_shape(real.hybrid, ParallelConfig()), torch.bfloat16)
    assert real.state_nbytes == pool.slot_nbytes == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    with pytest.raises(SystemExit, match="layer map"):
        config_from_args(p.parse_args(["--preset", "qwen3.5", "--layers", "4"]), "/tmp/x.log")
    with pytest.raises(SystemExit, match="hybrid"):
        tp_config_from_args(p.parse_args(["--preset", "tiny-qwen3.5", "--decode-tp", "2"]), "/tmp/x.log", "127.0.0.1")


def _tiny_gpt_oss(args: list[str]):
    p = argparse.ArgumentParser()
    add_args(p)
    return p, config_from_args(p.parse_args(["--preset", "tiny-gpt-oss", *args]), "/tmp/x.log")


def test_sliding_shapes_move_the_prompts_last_window_only():
    p, cfg = _tiny_gpt_oss(["--prompt-lens", "100,20", "--page-size", "16"])
    # 4 layers, sliding first (0, 2), window 32; KV 4 heads x 16 fp32
    assert (cfg.num_layers, cfg.kv_heads, cfg.head_dim, cfg.dtype) == (4, 4, 16, "float32")
    assert cfg.sliding_layers == (0, 2) and cfg.sliding_window == 32
    # 100 tokens: 7 pages; the first decode query (position 100) sees keys 69.., page 69 // 16 = 4 on
    assert cfg.window_pages(100) == (4, 7) and cfg.window_pages(20) == (0, 2)
    assert cfg.max_window_pages == 3 and cfg.prefill_pages == 7 + 3 and cfg.pool_pages == 7 + 3
    # one page of one layer, K and V: 2 x 4 heads x 16 tokens x 16 dims x 4 bytes = 8192
    shape = lookup_shape("tiny-gpt-oss")
    assert shape is not None and shape.request_kv_nbytes(100, 16) == 2 * 7 * 8192 + 2 * 3 * 8192 == 163840
    assert shape.request_kv_nbytes(20, 16) == 4 * 2 * 8192  # shorter than the window: every page
    real = EXTRA_SHAPES["gpt-oss-20b"]
    assert (real.num_layers, real.kv_heads, real.head_dim, real.dtype, real.sliding_window) == (
        24,
        8,
        64,
        "bfloat16",
        128,
    )
    assert real.sliding_layers == (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22) and real.kv_token_nbytes == 49152
    # 1024 tokens, page 16: 64 pages; window from page (1024 - 127) // 16 = 56: 8 pages per sliding layer;
    # one page of one layer: 2 x 8 x 16 x 64 x 2 = 32768
    assert real.request_kv_nbytes(1024, 16) == (12 * 64 + 12 * 8) * 32768 == 28311552
    with pytest.raises(SystemExit, match="layer map"):
        config_from_args(p.parse_args(["--preset", "tiny-gpt-oss", "--layers", "2"]), "/tmp/x.log")
    with pytest.raises(SystemExit, match="sliding-window"):
        tp_config_from_args(p.parse_args(["--preset", "tiny-gpt-oss", "--decode-tp", "2"]), "/tmp/x.log", "127.0.0.1")


@pytest.mark.parametrize("fragmentation", [0.0, 0.5])
def test_sliding_plan_moves_full_pages_and_window_pages_exactly(fragmentation):
    """The bench's plan on aliased pools (no engine): bytes against a hand computation, and a
    local copy along its ops lands exactly the digested pages, nothing else."""
    _, cfg = _tiny_gpt_oss(["--prompt-lens", "100", "--page-size", "16", "--fragmentation", str(fragmentation)])

    def pool(pages: int) -> KVPool:
        return KVPool(cfg.num_layers, pages, cfg.page_size, cfg.kv_heads, cfg.head_dim, swa_layers=cfg.sliding_layers)

    src, dst = pool(cfg.prefill_pages), pool(cfg.pool_pages)
    assert src.num_tensors == 2  # layer 0 shares layer 1's tensors, layer 2 layer 3's
    g = torch.Generator().manual_seed(0)
    for t in {id(b): b for b in src.buffers()}.values():
        t.copy_(torch.randn(t.shape, generator=g))
    rng = np.random.default_rng(3)
    src_pages, dst_pages = np.arange(7), fragmented_pages(7, cfg.fragmentation, rng)
    src_swa, dst_swa = source_window_table(100, cfg), decode_window_table(100, cfg, dst_pages, rng)
    assert src_swa is not None and dst_swa is not None
    assert src_swa.tolist() == [-1] * 4 + [7, 8, 9] and (dst_swa[:4] == -1).all()
    assert not set(dst_swa[4:].tolist()) & set(dst_pages.tolist())
    pages = RequestPages(src_pages, dst_pages, src_swa, dst_swa)
    plan = plan_request(pages, KVLayout.from_pool(src), KVLayout.from_pool(dst))
    # full layers 1, 3: 7 pages; sliding layers 0, 2: 3 pages; 8192 bytes per page, K and V
    assert plan.nbytes == (2 * 7 + 2 * 3) * 8192 == 163840
    assert plan.parts[0].layer_ids.tolist() == [1, 3] and plan.parts[1].layer_ids.tolist() == [0, 2]
    # carry the ops out in memory: the destination's digest of the moved pages matches the source's
    for s_, d_, n_ in zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.length.tolist()):
        ctypes.memmove(d_, s_, n_)
    assert digest(dst, dst_pages, swa_pages=dst_swa) == digest(src, src_pages, swa_pages=src_swa)
    # exactly those: every other byte of the destination is still zero (fp32: 4 bytes an element)
    written = sum(int(t.count_nonzero()) for t in {id(b): b for b in dst.buffers()}.values())
    assert written == plan.nbytes // 4
    # and the digest sees a sliding layer's window page
    dst.k[0][int(dst_swa[-1])].zero_()
    assert digest(dst, dst_pages, swa_pages=dst_swa) != digest(src, src_pages, swa_pages=src_swa)


def _timed_row(**shape) -> dict:
    """One length's result as the workers report it: `shape` (sizes and ops) plus fixed timings."""
    return {
        **shape,
        "planning_ms": 0.3,
        "transfer_ms": 1.0,
        "raw_ms": 1.0,
        "best_raw_ms": 1.0,
        "goodput_gbps": 0.15,
        "unsplit_goodput_gbps": None,
        "raw_goodput_gbps": 0.15,
        "best_raw_goodput_gbps": 0.15,
        "goodput_ratio": 1.0,
        "best_raw_ratio": 1.0,
        "best_raw_ratio_paired": 1.0,
        "best_raw": {"piece_bytes": 0, "window": 1, "label": "1 op"},
        "sweep": [],
        "split_compare": [],
        "verified": True,
    }


def test_sliding_table_shows_window_bytes_against_every_page():
    _, cfg = _tiny_gpt_oss(["--prompt-lens", "100"])
    length = _timed_row(
        prompt_len=100,
        pages=7,
        bytes=163840,
        kv_bytes=163840,
        state_bytes=0,
        window_pages=3,
        all_pages_bytes=229376,
        window_ratio=163840 / 229376,
        ops_per_request=8,
        kv_ops=8,
        state_ops=0,
        pieces_per_request=8,
        runs=1,
    )
    report = summarize({"lengths": [length], "engine_generation": 0}, cfg, None)
    assert report["config"]["sliding_layers"] == [0, 2] and report["config"]["sliding_window"] == 32
    table = format_table(report)
    assert table.startswith("2 of 4 layers sliding (window 32)")
    assert "    100      0.2           0.2  0.714            3" in table


def test_hybrid_table_splits_kv_and_state():
    p = argparse.ArgumentParser()
    add_args(p)
    cfg = config_from_args(p.parse_args(["--preset", "tiny-qwen3.5", "--prompt-lens", "64"]), "/tmp/x.log")
    length = _timed_row(
        prompt_len=64,
        pages=4,
        bytes=32768 + 116736,
        kv_bytes=32768,
        state_bytes=116736,
        ops_per_request=8,
        kv_ops=2,
        state_ops=6,
        pieces_per_request=8,
        runs=1,
    )
    report = summarize({"lengths": [length], "engine_generation": 0}, cfg, None)
    assert report["config"]["model_layers"] == 4 and report["config"]["kv_layers"] == [3]
    table = format_table(report)
    assert "hybrid 4L: state of 3 linear layers" in table and "KV MiB state MiB" in table
    assert "     64      0.0       0.1      2         6" in table


def test_the_processes_exchange_typed_messages():
    a, b = multiprocessing.Pipe()
    prefill, decode = Peer(a), Peer(b)
    prefill.send(DigestPages(np.arange(3), None))
    msg = decode.recv()
    assert isinstance(msg, DigestPages) and msg.pages.tolist() == [0, 1, 2] and msg.window_table is None
    decode.send(PagesDigest("ab"))
    assert prefill.expect(PagesDigest).hexdigest == "ab"
    decode.send(PoolZeroed())
    with pytest.raises(ProtocolError, match="expected PagesDigest, got PoolZeroed"):
        prefill.expect(PagesDigest)
