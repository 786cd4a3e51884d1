"""The sliding-window prefix cache (full-layer pages for every token, window pages where a hit may
start) in a colocated engine on tiny-gpt-oss (window 32, pages of 16, prompts up to 100 tokens):
greedy tokens and logprobs with the cache on equal those with it off for shared system prompts
and a multi-turn conversation, one at a time and batched, chunked or not, with cached_tokens > 0
for the repeated prefixes; a small KV pool forces eviction and still gives the same outputs; an
aborted request leaves nothing in the cache and every page free; and every page of either kind is
accounted for at the end."""

from __future__ import annotations

import random
import time

import pytest

from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.model.presets import write_preset
from tests.helpers.engine import generations, one_at_a_time
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


def system_prompts(seed: int = 0) -> list[list[int]]:
    """Groups of prompts sharing a system prompt, then two unrelated ones."""
    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(3, 250) for _ in range(n)]  # noqa: E731
    out = []
    for n in SYSTEM_LENS:
        system = tok(n)
        out += [system + tok(rnd.randint(3, 30)) for _ in range(PER_SYSTEM)]
    return out + [tok(20), tok(33)]


def conversation(eng: Engine, seed: int = 1) -> tuple[list[list[int]], list[Generation]]:
    """TURNS turns, each prompt the previous one, its answer and a new message, one at a time."""
    rnd = random.Random(seed)
    prompt, ps, gens = [rnd.randrange(3, 250) for _ in range(40)], [], []
    for _ in range(TURNS):
        ps.append(prompt)
        gens.append(one_at_a_time(eng, [prompt], GREEDY)[0])
        prompt = prompt + list(gens[-1].tokens) + [rnd.randrange(3, 250) for _ in range(rnd.randint(5, 20))]
    return ps, gens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset("tiny-gpt-oss", tmp_path_factory.mktemp("tiny_gpt_oss_cache"))


@pytest.fixture(scope="module")
def reference(model_dir) -> tuple[list[list[int]], list[Generation]]:
    """Cache off, one prompt at a time: the shared-system prompts, then the conversation's turns."""
    eng = make_engine(model_dir, radix_cache=False)
    try:
        assert eng.prefix_cache is None
        ps = system_prompts()
        gens = one_at_a_time(eng, ps, GREEDY)
        turns, turn_gens = conversation(eng)
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
        assert all(c % PS == 0 and c < len(p) for c, p in zip(cached, ps))
        # per system prompt: the first caches its prompt with the window before its prompt end;
        # the second finds the full pages of the shared prefix and the window there only if the
        # first prompt's end fell in the same page (else it keeps the window there: the branch
        # point); the rest hit it
        for g, n in enumerate(SYSTEM_LENS):
            group, shared = cached[g * PER_SYSTEM : (g + 1) * PER_SYSTEM], n // PS * PS
            first_end = (len(ps[g * PER_SYSTEM]) - 1) // PS * PS
            assert group[0] == 0 and group[1] == (shared if first_end == shared else 0), (n, group)
            assert group[2:] == [shared] * (PER_SYSTEM - 2), (n, group)
        turns = cached[-TURNS:]
        assert turns[0] == 0 and all(c >= 32 for c in turns[1:]), turns  # each turn reuses the last
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
