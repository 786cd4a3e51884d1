"""The keyed digest of a room's KV (transfer/kv_digest.py): equal bytes give equal digests on any
two pools that hold them (whole pools or a TP rank's head slice), one changed byte in a covered
page changes it, pages and layers outside it do not; and what its benchmark reports."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvpipe.bench.transfer import kv_digest as bench
from kvpipe.transfer.kv_digest import DIGEST_BYTES, KVDigester
from tests.helpers.kv_transfer import rank_pool, truth

KEY = bytes(range(16))


def test_equal_bytes_equal_digests_across_tp_slices_and_one_byte_changes_it() -> None:
    data = truth(seed=3)
    whole, whole_layout = rank_pool(1, 0, data)
    half, half_layout = rank_pool(2, 1, data)  # holds head 1 only
    pages = np.array([7, 2, 5])
    d_whole = KVDigester(whole.buffers(), whole_layout)
    d_half = KVDigester(half.buffers(), half_layout)
    assert len(d_whole.digest(KEY, pages, (0, 2))) == DIGEST_BYTES
    assert d_whole.digest(KEY, pages, (1, 2)) == d_half.digest(KEY, pages, (1, 2))
    assert d_whole.digest(KEY, pages, (0, 1)) != d_whole.digest(KEY, pages, (1, 2))
    assert d_whole.digest(KEY, pages, (0, 2)) != d_whole.digest(bytes(16), pages, (0, 2))  # keyed
    before = d_whole.digest(KEY, pages, (0, 2))
    whole.buffers()[3].view(torch.uint8)[9, 0, 0, 0] ^= 1  # a page outside the room
    assert d_whole.digest(KEY, pages, (0, 2)) == before
    whole.buffers()[3].view(torch.uint8)[5, 1, 3, 7] ^= 1  # one bit of a covered page
    assert d_whole.digest(KEY, pages, (0, 2)) != before


def test_sliding_window_layers_are_not_covered() -> None:
    pool, layout = rank_pool(1, 0, truth(seed=4))
    swa = dataclasses.replace(layout, swa_layers=(1,))
    d = KVDigester(pool.buffers(), swa)
    before = d.digest(KEY, np.arange(4), (0, 2))
    pool.buffers()[2].view(torch.uint8)[1] ^= 1  # layer 1's K: a window layer
    assert d.digest(KEY, np.arange(4), (0, 2)) == before
    pool.buffers()[0].view(torch.uint8)[1] ^= 1  # layer 0's K
    assert d.digest(KEY, np.arange(4), (0, 2)) != before


def test_the_benchmark_reports_its_cost_per_mb() -> None:
    out = bench.main(["--mb", "1", "--repeat", "1", "--page-size", "16"])
    assert out["mb"] >= 0.9 and out["digest_ms_per_mb"] > 0 and out["blake2b_mb_per_s"] > 0
