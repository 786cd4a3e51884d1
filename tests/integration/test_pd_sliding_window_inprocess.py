"""PD of tiny-gpt-oss (sliding window 32) with a prefill Engine and a decode Engine in one
process (local backend, real bootstrap and ZMQ): greedy tokens and logprobs equal the colocated
engine's with and without chunked prefill (chunks that cut the window and the pages) and layer
groups; the bytes written are every page of the full layers plus the prompt's last-window pages
of the sliding layers; every page (both tables) is free afterwards on both sides, also after
injected transfer failures and aborts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.presets import write_preset
from tests.helpers.pd_pair import PS, colocated_greedy, failures_then_decode_abort, greedy_and_bytes_as_predicted

LENS = [1, 16, 31, 33, 40, 64, 100, 150]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_preset("tiny-gpt-oss", tmp_path_factory.mktemp("tiny_gpt_oss_pd"))


@pytest.fixture(scope="module")
def reference(model_dir):
    yield from colocated_greedy(model_dir)


@pytest.mark.parametrize("chunk,groups", [(0, 1), (24, 1), (24, 2)])
def test_greedy_matches_colocated_and_only_window_pages_move(model_dir, reference, chunk, groups):
    mc = model_config_of(model_dir)
    every_page = sum(-(-n // PS) for n in LENS) * PS * mc.num_kv_heads * mc.head_dim * 4 * 2 * mc.num_layers

    def check(pair, st) -> None:
        assert st["bytes_written"] < 0.8 * every_page  # the sliding half sends its window only
        # window pages slide out: the prefill's cache keeps them only where a hit may start
        assert isinstance(pair.prefill.prefix_cache, SWARadixCache)

    greedy_and_bytes_as_predicted(model_dir, reference, chunk, groups, LENS, check)


def test_fp8_kv_matches_colocated_fp8(model_dir):
    """--kv-cache-dtype fp8_e4m3 on both sides (window pages, sinks), two layer groups: the
    colocated fp8 engine's tokens and logprobs; bytes for 1-byte elements."""
    ref = colocated_greedy(model_dir, "fp8_e4m3")
    try:
        greedy_and_bytes_as_predicted(model_dir, next(ref), 0, 2, LENS, kv_cache_dtype="fp8_e4m3")
    finally:
        ref.close()


def test_failures_and_aborts_free_every_page(model_dir, reference):
    failures_then_decode_abort(model_dir, reference)  # settle() checks both page tables' pages
