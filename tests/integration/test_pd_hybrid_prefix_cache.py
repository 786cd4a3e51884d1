"""PD of the hybrid tiny-qwen3.5 preset with the decode's radix cache (--disaggregation-enable-
decode-radix-cache; prefill and decode engines in one process over the local backend): the decode
never computes a prompt, so its cache matches KV alone; the prefill sends the full-attention pages
past the decode's prefix and the prompt's final state whole. Greedy tokens and logprobs equal the
colocated engine without a cache for a shared system prompt and a multi-turn conversation; the
bytes of every request are exactly its suffix pages plus one state; every page and slot is free
afterwards on both sides, also after 30% injected write failures, eviction from small pools and
aborts on either side (every page, state slot and snapshot accounted for)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.engine.request import FinishReason
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.presets import write_preset
from tests.helpers.pd_pair import (
    FAULTS,
    PS,
    Pair,
    colocated_greedy,
    decode_abort_in_flight,
    make_pair,
    prompts,
    run_one,
    shared_prefix_failure_waves,
)
from tests.helpers.pd_parity import expected_bytes, state_slot_nbytes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("tiny_qwen35_pd_cache"))


@pytest.fixture(scope="module")
def reference(model_dir):
    yield from colocated_greedy(model_dir)


@pytest.mark.parametrize("prefill_cache", [False, True])
def test_decode_cache_moves_the_suffix_pages_and_one_state(model_dir, reference, prefill_cache):
    """With the prefill's own cache too (state snapshots, as colocated) it skips computing the
    shared prefix and reports it as cached_tokens; the bytes do not change."""
    rnd = random.Random(7)
    tok = lambda n: [rnd.randrange(3, 290) for _ in range(n)]  # noqa: E731
    state = state_slot_nbytes(model_config_of(model_dir))
    page = expected_bytes(model_dir, [PS], PS, 1, 1) - state  # one page of the full-attention layer

    def predicted(n: int, held: int) -> int:
        return (-(-n // PS) - held // PS) * page + state

    with make_pair(model_dir, 24, decode_radix_cache=True, prefill_radix_cache=prefill_cache) as pair:
        cache = pair.decode.prefix_cache
        assert cache is not None and not isinstance(cache, HybridRadixCache)  # KV alone
        assert isinstance(pair.prefill.prefix_cache, HybridRadixCache) == prefill_cache
        system = tok(40)
        computed = []
        for i in range(4):  # a shared system prompt: 2 whole pages
            ids = system + tok(rnd.randint(20, 30))  # its prompt end lies past the system prompt
            sent, hit, d = run_one(pair, ids, reference)
            assert hit == (0 if i == 0 else 32) and sent == predicted(len(ids), hit), (i, hit, sent)
            computed.append(d.cached_tokens)
        # the prefill: the second finds the KV of the shared pages but a state only at the first's
        # chunk boundary 16 (chunks of 24, floored to a page) and snapshots the branch point 32;
        # the rest hit it
        assert computed == ([0, 16, 32, 32] if prefill_cache else [0] * 4)
        convo = tok(30)
        for turn in range(4):  # each turn resends the conversation so far
            sent, hit, d = run_one(pair, convo, reference)
            assert hit % PS == 0 and (turn == 0 or hit >= len(convo) - 30) and sent == predicted(len(convo), hit)
            convo = convo + list(d.output_ids) + tok(5 + turn)
        pair.settle()
        for eng in (pair.prefill, pair.decode):
            assert eng.state_slots is not None and eng.state_slots.in_use() == {}
            c = eng.prefix_cache
            assert c is None or (c.locked_pages == 0 and eng.allocator.num_used == c.num_pages)
        p_cache = pair.prefill.prefix_cache
        if isinstance(p_cache, HybridRadixCache):
            assert p_cache.snapshots.num_used == p_cache.num_snapshots > 0


def assert_accounted(pair: Pair) -> None:
    """Idle: on either side every used page is its cache's (each once, none pinned) and every state
    slot is free; every snapshot slot in use is one the prefill's cache holds, once."""
    for eng in (pair.prefill, pair.decode):
        assert eng.state_slots is not None and eng.state_slots.in_use() == {}
        c = eng.prefix_cache
        assert c is not None and c.locked_pages == 0
        held = c.all_pages()
        assert eng.allocator.num_used == c.num_pages == held.size
        eng.allocator.check_owned(held)
    p_cache = pair.prefill.prefix_cache
    assert isinstance(p_cache, HybridRadixCache)
    snaps = p_cache.all_snapshots()
    assert p_cache.snapshots.num_used == p_cache.num_snapshots == len(set(snaps)) == len(snaps)


def test_failures_eviction_and_aborts_leave_everything_accounted_for(model_dir, reference):
    """Both caches on, 30% injected write failures, 24-page pools on both sides and 3 snapshot slots
    on the prefill (pages and snapshots evicted all the time), prompts sharing a system prompt
    prefilled in chunks (chunk-boundary snapshots): the rooms that succeed give the colocated
    tokens; then a decode abort and a prefill abort while the prompt computes. After each, every
    page, state slot and snapshot is accounted for."""
    slots = {"max_state_slots": 4, "max_mamba_cache_size": 7}  # 4 running, 3 snapshots
    with make_pair(model_dir, 32, 24, 24, FAULTS, decode_radix_cache=True, prefill_cache=slots) as pair:
        p_cache = pair.prefill.prefix_cache
        assert isinstance(p_cache, HybridRadixCache) and p_cache.snapshots.num_slots == 3
        system = shared_prefix_failure_waves(pair, reference)
        assert_accounted(pair)
        decode_abort_in_flight(pair, system + prompts(1, [200])[0])
        assert_accounted(pair)
        p, d = pair.reqs(system + prompts(2, [200])[0])  # the prefill aborts after its first chunk
        pair.prefill.add_request(p)
        pair.decode.add_request(d)
        pair.prefill.step()
        pair.prefill.abort(p.rid)
        pair.run([], until=lambda: p.finished and d.finished)
        assert p.finish_reason is FinishReason.ABORT and d.finish_reason is FinishReason.ABORT
        pair.settle()
        assert_accounted(pair)
