"""KV tier keys and records (cache/store_keys.py) and pool pages as bytes (cache/store_pages.py):
a key names the page's whole prefix and everything that makes its bytes comparable; a record is
used only under its own key with its own digest; pages survive the trip through bytes."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.store_keys import StoreNamespace, decode_page, encode_page, page_keys
from kvpipe.cache.store_pages import PoolPages
from kvpipe.commands.hicache_flags import add_hicache_args, hicache_config_from_args, parse_bytes
from kvpipe.config import ConfigError, HiCacheConfig

NS = StoreNamespace("ab" * 32, "torch.float32", 4, 4, 2, 8)


def test_keys_chain_over_the_prefix() -> None:
    ids = list(range(3, 14))  # 2 whole pages of 4, and 3 tokens left over
    keys = page_keys(NS, ids)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert page_keys(NS, ids[:8]) == keys  # the same pages, the same keys
    other_first = page_keys(NS, [99, *ids[1:]])
    assert other_first[1] != keys[1]  # page 1's key names page 0 too
    assert page_keys(NS, ids[4:8])[0] != keys[1]  # the same tokens after another prefix


@pytest.mark.parametrize(
    "change",
    [
        {"model_digest": "cd" * 32},
        {"kv_dtype": "torch.bfloat16"},
        {"page_size": 2},
        {"num_buffers": 2},
        {"kv_heads": 1},
        {"head_dim": 4},
        {"tp_rank": 1, "tp_size": 2},
    ],
)
def test_anything_that_changes_the_bytes_changes_the_keys(change: dict) -> None:
    other = dataclasses.replace(NS, **change)
    ids = list(range(16))
    assert set(page_keys(other, ids[: 8 // NS.page_size * other.page_size])).isdisjoint(page_keys(NS, ids))


def test_records_check_key_length_and_digest() -> None:
    k0, k1 = page_keys(NS, list(range(8)))
    payload = bytes(range(256)) * 2
    blob = encode_page(k0, payload)
    assert bytes(decode_page(k0, blob, len(payload)) or b"") == payload
    assert decode_page(k1, blob, len(payload)) is None  # a valid record of another page
    assert decode_page(k0, blob, len(payload) - 1) is None  # another geometry
    flipped = bytearray(blob)
    flipped[-7] ^= 1
    assert decode_page(k0, bytes(flipped), len(payload)) is None
    assert decode_page(k0, b"garbage" * 100, len(payload)) is None
    assert decode_page(k0, b"", len(payload)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_pool_pages_round_trip(dtype: torch.dtype) -> None:
    src = KVPool(3, 6, 4, 2, 8, dtype=dtype, compute_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for buf in src.buffers():
        buf.view(torch.uint8).copy_(torch.randint(0, 120, buf.view(torch.uint8).shape, generator=gen))
    io = PoolPages(src)
    assert io.payload_bytes == 6 * 2 * 4 * 8 * src.k[0].element_size()
    payloads = io.read(np.array([4, 1]))
    dst = KVPool(3, 6, 4, 2, 8, dtype=dtype, compute_dtype=torch.float32)
    PoolPages(dst).write(np.array([0, 5]), payloads)
    for a, b in zip(src.buffers(), dst.buffers()):
        assert torch.equal(a[4].view(torch.uint8), b[0].view(torch.uint8))
        assert torch.equal(a[1].view(torch.uint8), b[5].view(torch.uint8))
        assert not b[2].view(torch.uint8).any()  # nothing else written
    with pytest.raises(ValueError):
        PoolPages(dst).write(np.array([0]), [payloads[0][:-1]])


def test_hicache_flags() -> None:
    assert parse_bytes("256mb") == parse_bytes("256M") == 256 << 20 and parse_bytes("4096") == 4096
    p = argparse.ArgumentParser()
    add_hicache_args(p, env={"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1gb"})
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--disable-radix-cache", action="store_true")
    cfg = hicache_config_from_args(
        p.parse_args(["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"])
    )
    assert (cfg.enabled, cfg.mooncake_master, cfg.mooncake_global_segment_bytes) == (True, "10.0.0.1:50051", 1 << 30)
    assert cfg.mooncake_metadata_server == "P2PHANDSHAKE"
    assert not hicache_config_from_args(p.parse_args([])).enabled
    tp2 = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake", "--tp-size", "2"]
    assert hicache_config_from_args(p.parse_args(tp2)).enabled  # every TP rank stores its own head slice
    for bad in (
        ["--enable-hierarchical-cache"],  # no backend: kvpipe has no host tier to enable alone
        ["--hicache-storage-backend", "mooncake"],
        ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake", "--disable-radix-cache"],
    ):
        with pytest.raises(ConfigError):
            hicache_config_from_args(p.parse_args(bad))
    with pytest.raises(ConfigError):
        HiCacheConfig(enabled=True, storage_backend="mooncake")  # no master
