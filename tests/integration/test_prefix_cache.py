"""The radix (prefix) cache in a colocated engine: greedy outputs (tokens and logprobs) with the
cache equal outputs without it for prompts sharing prefixes of varied lengths (page-aligned and not), chunk sizes that
do not divide the page size, one at a time and batched; cached_tokens says what was skipped; a
pool small enough to force eviction still serves everything exactly and ends with every page
free or evictable."""

from __future__ import annotations

import random

import pytest

from kvpipe.engine.request import Req, SamplingParams
from tests.helpers.engine import generations, make_engine, one_at_a_time
from tests.helpers.tolerance import Generation, Route, assert_same_generations

PS = 16
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Groups sharing a system prompt (page-aligned and not), plus a multi-turn conversation that
    resends itself, plus unrelated prompts."""
    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(3, 250) for _ in range(n)]  # noqa: E731
    out = []
    for sys_len in (48, 37, 70):  # 3 pages exactly; 2 pages + 5; 4 pages + 6
        system = tok(sys_len)
        out += [system + tok(rnd.randint(1, 40)) for _ in range(4)]
    convo = tok(20)
    for _ in range(3):  # each turn: everything so far plus a new user message
        convo = convo + tok(rnd.randint(5, 30))
        out.append(list(convo))
    out += [tok(n) for n in (1, 15, 16, 17)]
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[Generation]:
    eng = make_engine(tiny_model_dir, page_size=PS)
    try:
        return one_at_a_time(eng, shared_prefix_prompts(), GREEDY)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("chunk", [0, 24])  # 24 does not divide into pages of 16
def test_cache_keeps_outputs_and_reports_cached_tokens(tiny_model_dir, reference, chunk):
    eng = make_engine(tiny_model_dir, page_size=PS, chunk=chunk, radix_cache=True)
    try:
        ps = shared_prefix_prompts()
        results = [eng.generate([p], GREEDY)[0] for p in ps]  # one at a time: later ones hit the cache
        assert_same_generations([Generation.of(r) for r in results], reference, Route.SAME_PROCESS, ps, "one at a time")
        cached = [r["meta_info"]["cached_tokens"] for r in results]
        assert all(c % PS == 0 and c < len(p) for c, p in zip(cached, ps))
        assert cached[0] == 0 and cached[1] == 48  # the second of the group reuses the 3-page system prompt
        assert cached[5] == 32  # 37-token system prompt: 2 whole pages are shared
        assert sum(cached) > 0.3 * sum(len(p) for p in ps)
        # batched: the same outputs again (everything is cached now)
        assert_same_generations(generations(eng, ps, GREEDY), reference, Route.SAME_PROCESS, ps, "batched")
        st = eng.stats()
        assert st["cached_pages"] > 0 and st["free_pages"] == st["total_pages"]  # all evictable at idle
        assert eng.prefix_cache is not None and eng.prefix_cache.locked_pages == 0
    finally:
        eng.shutdown()


def test_eviction_under_page_pressure(tiny_model_dir, reference):
    """A pool of 14 pages: the cache must give pages back for each new prompt; outputs stay exact
    and no page is lost or shared by two owners."""
    eng = make_engine(tiny_model_dir, page_size=PS, chunk=24, pages=14, radix_cache=True)
    try:
        ps = shared_prefix_prompts()
        for _ in range(2):
            assert_same_generations(one_at_a_time(eng, ps, GREEDY), reference, Route.SAME_PROCESS, ps)
        cache = eng.prefix_cache
        assert cache is not None and cache.locked_pages == 0
        held = cache.all_pages()
        eng.allocator.check_owned(held)  # the cache's pages are allocated, each once
        assert eng.allocator.num_used == cache.num_pages  # nothing else holds a page
        st = eng.stats()
        assert st["free_pages"] == st["total_pages"] == 14
    finally:
        eng.shutdown()


def test_aborted_and_rejected_requests_leave_pages_consistent(tiny_model_dir):
    eng = make_engine(tiny_model_dir, page_size=PS, chunk=24, pages=20, radix_cache=True)
    try:
        p = shared_prefix_prompts()[0]
        eng.generate([p], GREEDY)
        a = Req("a", list(p), SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True))
        eng.add_request(a)
        eng.step()  # admitted with the cached prefix, prefilled
        assert a.cached_tokens > 0 and eng.prefix_cache.locked_pages > 0
        eng.abort("a")
        eng.step()
        assert a.finished and eng.prefix_cache.locked_pages == 0
        too_long = Req("b", list(range(3, 3 + 400)), GREEDY)  # needs more pages than the pool has
        eng.add_request(too_long)
        eng.step()
        assert too_long.finished and eng.prefix_cache.locked_pages == 0
        st = eng.stats()
        assert st["free_pages"] == st["total_pages"]
        eng.allocator.check_owned(eng.prefix_cache.all_pages())
        assert eng.allocator.num_used == eng.prefix_cache.num_pages
    finally:
        eng.shutdown()
