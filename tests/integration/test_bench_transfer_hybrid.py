"""`kvpipe bench transfer` end to end on the tiny Qwen3.5 shape: two processes over real Mooncake
(TCP loopback) move a 64-token request's full-attention KV plus its recurrent-state slot, and
the decode's digest of both matches. Nothing is timed; bytes and ops are checked by hand."""

from __future__ import annotations

import argparse

import pytest

from kvpipe.bench.transfer.command import add_args, run_bench

pytest.importorskip("mooncake.engine")

pytestmark = pytest.mark.timeout(120)


def test_tiny_qwen3_5_moves_kv_and_state_and_verifies():
    p = argparse.ArgumentParser()
    add_args(p)
    report = run_bench(
        p.parse_args(
            [
                "--preset",
                "tiny-qwen3.5",
                "--prompt-lens",
                "64",
                "--repeat",
                "1",
                "--raw-pieces",
                "64K",
                "--raw-windows",
                "8",
                "--timeout",
                "90",
            ]
        )
    )
    (x,) = report["lengths"]
    assert report["verified"] and x["verified"]
    # KV: 4 pages of 16 tokens, full-attention layer 3 only: K and V of 2 heads x 32, fp32
    assert x["kv_bytes"] == 64 * 2 * 2 * 32 * 4
    # state: 3 linear layers x (conv [512 channels, 3] fp32 + recurrent [8, 32, 32] fp32)
    assert x["state_bytes"] == 3 * (512 * 3 * 4 + 8 * 32 * 32 * 4)
    assert x["bytes"] == x["kv_bytes"] + x["state_bytes"]
    # one contiguous run: one op per KV buffer (K, V); one per linear layer and conv|recurrent
    assert (x["kv_ops"], x["state_ops"], x["ops_per_request"]) == (2, 6, 8)
    assert all(s["ms"] > 0 for s in x["sweep"]) and x["goodput_gbps"] > 0
