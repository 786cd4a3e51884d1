"""PD of tiny-gpt-oss (window 32, pages of 16; tiny-gemma3's too for the first test) with the decode's radix cache
(--disaggregation-enable-decode-radix-cache; prefill and decode engines in one process over the
local backend): the decode's cache is the sliding-window one; the decode computes no prompt token,
so its hit is its full-layer match (a shared system prompt hits though its window slid out of the
request that cached it), and the prefill sends the full layers' pages past the decode's prefix and
the window pages of the prompt's last window that the decode's cache lacks, below its prefix too.
Greedy tokens and logprobs equal the colocated engine without a cache for a shared system prompt
and a multi-turn conversation; the bytes of every request are exactly that prediction; the
prefill's own cache (on or off) saves its compute and changes no byte; every page of either kind
is accounted for afterwards on both sides."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.cache.window_pages import window_first_page
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.presets import write_preset
from tests.helpers.pd_pair import (
    FAULTS,
    GREEDY,
    PS,
    Pair,
    colocated_greedy,
    decode_abort_in_flight,
    make_pair,
    prompts,
    run_one,
    shared_prefix_failure_waves,
)
from tests.helpers.pd_parity import expected_bytes


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> Path:
    """tiny-gpt-oss, or the preset a test names (indirect): both have a window of 32."""
    name = getattr(request, "param", "tiny-gpt-oss")
    return write_preset(name, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def reference(model_dir):
    yield from colocated_greedy(model_dir)


@pytest.mark.parametrize(
    "model_dir,prefill_cache,groups",
    [("tiny-gpt-oss", False, 1), ("tiny-gpt-oss", True, 2), ("tiny-gemma3", True, 2)],
    indirect=["model_dir"],
)
def test_decode_cache_moves_suffix_pages_and_the_missing_window_pages(model_dir, reference, prefill_cache, groups):
    """With the prefill's own cache too it skips computing the shared prefix and reports it as
    cached_tokens, with two layer groups (each group's pages go while the next computes); the
    bytes do not change."""
    rnd = random.Random(7)
    tok = lambda n: [rnd.randrange(3, 290) for _ in range(n)]  # noqa: E731
    mc = model_config_of(model_dir)
    assert mc.sliding_window == 32 and 0 < len(mc.sliding_layers) < mc.num_layers
    layer_page = PS * mc.num_kv_heads * mc.head_dim * 4 * 2  # K and V of one page of one layer, fp32
    assert expected_bytes(model_dir, [PS], PS, 1, 1) == mc.num_layers * layer_page
    full_page = (mc.num_layers - len(mc.sliding_layers)) * layer_page
    window_page = len(mc.sliding_layers) * layer_page

    def predicted(n: int, hit: int, held: int) -> int:
        """Full layers: the pages past the decode's prefix of `hit` tokens; sliding layers: the
        pages of the prompt's last window but the `held` ones the decode's cache has (below hit)."""
        end, first = -(-n // PS), window_first_page(n, 32, PS)
        return (end - hit // PS) * full_page + (end - first - held) * window_page

    with make_pair(
        model_dir, 24, decode_radix_cache=True, prefill_radix_cache=prefill_cache, layer_groups=groups
    ) as pair:
        assert isinstance(pair.decode.prefix_cache, SWARadixCache)
        assert isinstance(pair.prefill.prefix_cache, SWARadixCache) == prefill_cache
        system = tok(40)
        computed, hits = [], []
        # a shared system prompt of 2 whole pages, prompts of 70, 60, 61 and 68 tokens: their last
        # windows start at logical pages 2, 1, 1, 2. The decode's hit is the system prompt's 2
        # full pages from the second on; of the window page before it (page 1) its cache holds
        # none for the second (the first never had it: it is the prefill's to send), then the one
        # the second kept (the window before its prompt's last page boundary, 48).
        held = [0, 0, 1, 0]
        for i, n in enumerate([30, 20, 21, 28]):
            ids = system + tok(n)
            sent, hit, d = run_one(pair, ids, reference)
            hits.append(hit)
            assert sent == predicted(len(ids), hit, held[i]), (i, hit, sent)
            computed.append(d.cached_tokens)
        assert hits == [0, 32, 32, 32], hits
        # the prefill: the second finds the full pages of the shared prefix but its window slid
        # out and keeps it (the branch point); the rest hit it
        assert computed == ([0, 0, 32, 32] if prefill_cache else [0] * 4)
        convo, prev = tok(30), 0
        for turn in range(4):  # each turn resends the conversation so far
            sent, hit, d = run_one(pair, convo, reference)
            # the decode cached the last turn up to its last KV (prompt + 5 outputs) with the window
            # before it: it holds that prefix, and the prefill sends the rest
            assert hit == (0 if turn == 0 else (prev + GREEDY.max_new_tokens - 1) // PS * PS), (turn, hit)
            # the window pages of the prompt's last window before the hit: the cache's (the last
            # turn's window before its end)
            held = max(0, hit // PS - window_first_page(len(convo), 32, PS))
            assert sent == predicted(len(convo), hit, held), (turn, hit, sent)
            prev, convo = len(convo), convo + list(d.output_ids) + tok(5 + turn)
        if groups > 1:
            assert pair.pipeline.counters.batches_by_groups.get(groups, 0) > 0
        pair.settle()
        assert_only_cached(pair)


def assert_only_cached(pair: Pair) -> None:
    """Idle: every used page of either side is its cache's, once, and none is pinned."""
    for eng in (pair.prefill, pair.decode):
        c = eng.prefix_cache
        assert c is None or isinstance(c, SWARadixCache)
        if isinstance(c, SWARadixCache):
            assert c.locked_pages == c.locked_swa_pages == 0
            assert eng.allocator.num_used == c.num_pages + c.num_swa_pages == c.all_pages().size
            eng.allocator.check_owned(c.all_pages())


def test_failed_and_aborted_transfers_insert_nothing_and_leak_nothing(model_dir, reference):
    """30% injected write failures with both caches on, prompts sharing a system prompt (hits on
    both sides), then a decode abort while the prefill computes: the rooms that succeed give the
    colocated tokens, and afterwards every page on either side is its cache's."""
    with make_pair(model_dir, chunk=32, inject=FAULTS, decode_radix_cache=True) as pair:
        system = shared_prefix_failure_waves(pair, reference)
        assert_only_cached(pair)
        decode_abort_in_flight(pair, system + prompts(1, [200])[0])
        assert_only_cached(pair)
