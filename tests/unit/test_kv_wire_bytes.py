"""KV bytes a PD request puts on the wire: sliding-window layers send the prompt's last window
only (hand-computed numbers), every other model every token of every KV layer."""

from __future__ import annotations

import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.window_pages import prompt_window_pages
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.wire_bytes import KVWireBytes

# tiny-gpt-oss: layers 0, 2 sliding (window 32), 1, 3 full; K and V of 4 heads x 16, fp32:
# 2 x 4 x 16 x 4 = 512 bytes per token and layer, 1024 over each pair of layers
TINY = KVWireBytes(1024, 1024, 32, 16)


def test_prompt_window_pages():
    # the first decode query sits at position L and sees keys L - 31 .. L
    assert prompt_window_pages(100, 32, 16) == (4, 7)  # key 69 is on page 4
    assert prompt_window_pages(20, 32, 16) == (0, 2)  # shorter than the window: every page
    assert prompt_window_pages(4096, 128, 64) == (62, 64)  # key 3969 is on page 62


def test_tiny_gpt_oss_request_by_hand():
    # 100 tokens: full layers every token; sliding layers the tokens of pages 4.. : 100 - 64 = 36
    assert TINY.swa_tokens(0, 100, 100) == 36
    assert TINY.request_nbytes(100) == 100 * 1024 + 36 * 1024 == 139264
    assert TINY.all_layers_nbytes(100) == 100 * 2048 == 204800
    # chunked prefill: the first chunk holds none of the window, the second all of it
    assert TINY.span_nbytes(0, 64, 100) == 64 * 1024
    assert TINY.span_nbytes(64, 100, 100) == 36 * 2048
    assert TINY.span_nbytes(48, 80, 100) == 32 * 1024 + 16 * 1024  # tokens 64..79 in the window
    # shorter than the window: every layer every token
    assert TINY.request_nbytes(20) == TINY.all_layers_nbytes(20) == 20 * 2048


def test_gpt_oss_20b_request_by_hand():
    # 12 full + 12 sliding layers, K and V of 8 heads x 64, bf16: 2048 bytes per token and layer
    real = KVWireBytes(12 * 2048, 12 * 2048, 128, 64)
    # 4096 tokens, page 64: window pages from 62: 4096 - 62 * 64 = 128 tokens
    assert real.request_nbytes(4096) == 4096 * 24576 + 128 * 24576 == 103809024
    assert real.request_nbytes(4096) / real.all_layers_nbytes(4096) == pytest.approx(4224 / 8192)
    # 4000 tokens: the window starts at key 3873, page 60: 4000 - 3840 = 160 tokens
    assert real.swa_tokens(0, 4000, 4000) == 160


def test_without_sliding_layers_every_token_counts():
    plain = KVWireBytes(12288, page_size=16)
    assert plain.request_nbytes(1000) == 1000 * 12288 == plain.all_layers_nbytes(1000)
    assert plain.span_nbytes(100, 300, 1000) == 200 * 12288
    with pytest.raises(ValueError):
        KVWireBytes(10, 10, None, 16)


def test_from_layout_splits_full_and_sliding_layers():
    swa = KVLayout.from_pool(KVPool(4, 8, 16, 4, 16, swa_layers=(0, 2)))
    assert KVWireBytes.from_layout(swa, 32) == TINY
    plain = KVLayout.from_pool(KVPool(4, 8, 16, 4, 16))
    w = KVWireBytes.from_layout(plain, None)
    assert (w.full_token_nbytes, w.swa_token_nbytes, w.window) == (plain.token_nbytes, 0, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_bytes_follow_the_kv_dtype(dtype):
    """--kv-cache-dtype: the layout's token bytes (the layer-group cost model's per-token figure)
    and every request's wire bytes shrink by exactly itemsize / 4 against fp32 KV, sliding layers
    included; the page and head offsets the planner uses shrink alike."""
    fp32 = KVLayout.from_pool(KVPool(4, 8, 16, 4, 16, swa_layers=(0, 2)))
    low = KVLayout.from_pool(KVPool(4, 8, 16, 4, 16, dtype, swa_layers=(0, 2)))
    assert low.itemsize == dtype.itemsize and low.dtype == str(dtype).removeprefix("torch.")
    assert low.token_nbytes * 4 == fp32.token_nbytes * dtype.itemsize
    assert (low.page_nbytes * 4, low.head_nbytes * 4) == (
        fp32.page_nbytes * low.itemsize,
        fp32.head_nbytes * low.itemsize,
    )
    w32, w = KVWireBytes.from_layout(fp32, 32), KVWireBytes.from_layout(low, 32)
    for n in (1, 20, 100, 333):
        assert w.request_nbytes(n) * 4 == w32.request_nbytes(n) * dtype.itemsize
    assert fp32.compatible_with(low) is not None  # and the bootstrap's check refuses the pair
