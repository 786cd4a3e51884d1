"""The sliding-window prefix cache (full-layer pages for every token, window pages where a hit may
start) in a colocated engine on tiny-gpt-oss (window 32, pages of 16, prompts up to 100 tokens):
greedy tokens and logprobs with the cache on equal those with it off for shared system prompts
and a multi-turn conversation, one at a time and batched, chunked or not, with cached_tokens > 0
for the repeated prefixes; a small KV pool forces eviction and still gives the same outputs; an
aborted request leaves nothing in the cache and every page free; and every page of either kind is
accounted for at the end."""

from __future__ import annotations

import time

import pytest

from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.model.presets import write_preset
from tests.helpers.engine import generations, one_at_a_time
from tests.helpers.prefix_prompts import assert_system_and_turn_hits, conversation, system_prompts
from tests.helpers.tolerance import Generation, Route, assert_same_generations

PS = 16
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM_LENS = (48, 70)  # 3 pages exactly; 4 pages + 6: both past the window of 32
PER_SYSTEM = 3
TURNS = 3


def make_engine(
    model_dir, radix_cache: bool, chunk: int = 0, pages: int = 256, running: int = 64, tp: int = 1
) -> Engine:
    cfg = ServerConfig(
        model_path=str(model_dir),
        tp_size=tp,
        cache=CacheConfig(page_size=PS, num_pages=pages, radix_cache=radix_cache),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_running_requests=running),
    )
    return Engine(cfg)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset("tiny-gpt-oss", tmp_path_factory.mktemp("tiny_gpt_oss_cache"))


@pytest.fixture(scope="module")
def reference(model_dir) -> tuple[list[list[int]], list[Generation]]:
    """Cache off, one prompt at a time: the shared-system prompts, then the conversation's turns."""
    eng = make_engine(model_dir, radix_cache=False)
    try:
        assert eng.prefix_cache is None
        ps = system_prompts(SYSTEM_LENS, PER_SYSTEM)
        gens = one_at_a_time(eng, ps, GREEDY)
        turns, turn_gens = conversation(eng, TURNS, GREEDY)
        return ps + turns, gens + turn_gens
    finally:
        eng.shutdown()


def swa_cache(eng: Engine) -> SWARadixCache:
    assert isinstance(eng.prefix_cache, SWARadixCache)
    return eng.prefix_cache


def assert_accounted(eng: Engine) -> None:
    """Idle engine: nothing pinned, every used page is the cache's (each once, full or window);
    evicting everything frees every page."""
    cache = swa_cache(eng)
    assert cache.locked_pages == cache.locked_swa_pages == 0
    held = cache.all_pages()
    eng.allocator.check_owned(held)
    assert eng.allocator.num_used == cache.num_pages + cache.num_swa_pages == held.size
    eng.allocator.free(cache.evict(eng.allocator.num_pages))
    assert eng.allocator.num_free == eng.allocator.num_pages


def results(eng: Engine, ps: list[list[int]]) -> list[dict]:
    return [eng.generate([p], GREEDY)[0] for p in ps]


# 24 cuts both the pages of 16 and the window of 32; whole prompts in make test-full
@pytest.mark.parametrize("chunk", [pytest.param(0, marks=pytest.mark.slow), 24])
def test_cache_on_equals_off_and_reports_cached_tokens(model_dir, reference, chunk):
    ps, want = reference
    eng = make_engine(model_dir, radix_cache=True, chunk=chunk)
    try:
        got = results(eng, ps)  # one at a time: later prompts hit what earlier ones left
        assert_same_generations([Generation.of(r) for r in got], want, Route.SAME_PROCESS, ps, "one at a time")
        cached = [r["meta_info"]["cached_tokens"] for r in got]
        assert_system_and_turn_hits(cached, ps, SYSTEM_LENS, PER_SYSTEM, TURNS, PS)
        assert swa_cache(eng).num_swa_pages > 0
        # batched, everything cached now: the same outputs again
        assert_same_generations(generations(eng, ps, GREEDY), want, Route.SAME_PROCESS, ps, "batched")
        assert_accounted(eng)
    finally:
        eng.shutdown()


def test_eviction_under_pressure_keeps_outputs(model_dir, reference):
    """20 pages of 16 tokens for 2 running requests (the longest needs 7 full and 7 window pages):
    pages of both kinds are evicted all the time, outputs stay the same (one at a time: each
    prompt meets what the earlier ones left)."""
    ps, want = reference
    eng = make_engine(model_dir, radix_cache=True, chunk=24, pages=20, running=2)
    try:
        raw = results(eng, ps)
        assert_same_generations([Generation.of(r) for r in raw], want, Route.SAME_PROCESS, ps, "one at a time")
        assert sum(r["meta_info"]["cached_tokens"] for r in raw) > 0
        assert_accounted(eng)
    finally:
        eng.shutdown()


def test_an_aborted_request_caches_nothing(model_dir, reference):
    ps, want = reference
    eng = make_engine(model_dir, radix_cache=True, chunk=24)
    start = eng.allocator.num_free
    deadline = time.monotonic() + 300
    try:
        long = ps[PER_SYSTEM]  # 70-token system prompt: prefills in chunks of 24
        r = Req("doomed", long, SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True))
        eng.add_request(r)
        while len(r.output_ids) < 20:  # past the prompt end, the window slid past it
            assert time.monotonic() < deadline
            eng.step()
        assert (r.swa_pages >= 0).any()
        eng.abort(r.rid)
        eng.step()
        assert r.finish_reason is FinishReason.ABORT
        cache = swa_cache(eng)
        assert cache.num_pages == cache.num_swa_pages == 0 and eng.allocator.num_free == start
        # the cache still works for what follows
        got = [Generation.of(x) for x in results(eng, ps[:PER_SYSTEM])]
        assert_same_generations(got, want[:PER_SYSTEM], Route.SAME_PROCESS, ps[:PER_SYSTEM])
        assert_accounted(eng)
    finally:
        eng.shutdown()


@pytest.mark.slow  # make test-full: TP processes on top of the fast suite's cache tests
def test_tp2_with_the_cache_equals_tp1_without(model_dir, reference):
    """Every TP rank reads the same page tables, window pages from the cache included."""
    ps, want = reference
    n = 2 * PER_SYSTEM
    eng = make_engine(model_dir, radix_cache=True, chunk=24, tp=2)
    try:
        got = results(eng, ps[:n])
        assert_same_generations([Generation.of(r) for r in got], want[:n], Route.ACROSS_PROCESSES, ps[:n])
        assert [r["meta_info"]["cached_tokens"] for r in got][2:PER_SYSTEM] == [48] * (PER_SYSTEM - 2)  # system 48
        assert_accounted(eng)
    finally:
        eng.shutdown()
