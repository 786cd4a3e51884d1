"""The scheduler with a sliding-window prefix cache (SWARadixCache, no model): a repeated prompt,
a shared system prompt (a hit from the third request on: the second keeps the window where its
match outran the windows) and a multi-turn conversation hit, the hit restores the request's window
page table from the cache's pages and computes only the rest; an abort inserts nothing and frees
everything; the cache's pages stay pinned while a request reads them; a PD decode reserves only
the window pages it lacks; and every page of either kind is the cache's or one request's own
after every step, also under eviction pressure."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.cache.window_pages import window_first_page
from kvpipe.config import SchedulerConfig
from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.engine.scheduler import Scheduler

PS, W = 4, 10


def make(pages: int = 96, chunk: int = 0, running: int = 8) -> Scheduler:
    cfg = SchedulerConfig(chunked_prefill_size=chunk, max_running_requests=running)
    return Scheduler(cfg, PageAllocator(pages), PS, 4096, prefix_cache=SWARadixCache(PS, W), window=W)


def swa(s: Scheduler) -> SWARadixCache:
    assert isinstance(s.cache, SWARadixCache)
    return s.cache


def mk(rid: str, ids: list[int], max_new: int = 4) -> Req:
    return Req(rid, list(ids), SamplingParams(max_new_tokens=max_new))


def check(s: Scheduler) -> None:
    """Every used page is the cache's or one live request's own, once; a running request's shared
    window pages are the cache's, and its next query's window is all there."""
    cache = swa(s)
    owners = s.running + list(s.reserved.values()) + list(s.held.values())
    own = [r.pages[r.num_shared_pages :] for r in owners]
    own += [r.swa_pages[r.num_shared_pages :][r.swa_pages[r.num_shared_pages :] >= 0] for r in owners]
    held = cache.all_pages()
    allp = np.concatenate([held, *own])
    assert np.unique(allp).size == allp.size == s.allocator.num_used
    s.allocator.check_owned(allp)
    for r in s.running:
        shared = r.swa_pages[: r.num_shared_pages]
        assert set(shared[shared >= 0].tolist()) <= set(held.tolist())
        if r.num_cached:
            lo, hi = window_first_page(r.num_cached, W, PS), -(-r.num_cached // PS)
            assert (r.swa_pages[lo:hi] >= 0).all(), (r.rid, r.num_cached, r.swa_pages)


def step(s: Scheduler) -> ScheduledBatch | None:
    """One step of a fake model (token = 100 + seq_len); finish at max_new_tokens."""
    b = s.schedule()
    if b is None:
        return None
    toks = [100 + r.seq_len if b.completes_prefill(i) else None for i, r in enumerate(b.reqs)]
    s.commit(b, toks, [0.0 if t is not None else None for t in toks])
    for r, t in zip(b.reqs, toks):
        if t is not None and len(r.output_ids) >= r.params.max_new_tokens:
            s.finish(r, FinishReason.LENGTH)
    check(s)
    return b


def run(s: Scheduler, *reqs: Req) -> list[ScheduledBatch]:
    for r in reqs:
        assert s.add(r)
    out = []
    for _ in range(1000):
        b = step(s)
        if b is None:
            assert all(r.finished for r in reqs)
            return out
        out.append(b)
    raise AssertionError("did not drain")


def first_row(batches: list[ScheduledBatch], r: Req) -> tuple[int, int]:
    """(prefix_len, extend_len) of r's first forward."""
    b = next(b for b in batches if any(x is r for x in b.reqs))
    i = next(i for i, x in enumerate(b.reqs) if x is r)
    return b.prefix_lens[i], b.extend_lens[i]


@pytest.mark.parametrize("chunk", [0, 6])
def test_a_repeated_prompt_restores_the_window_and_computes_the_rest(chunk):
    s = make(chunk=chunk)
    ids = list(range(3, 33))  # 30 tokens: a repeat hits 28 (7 pages), the window before it is [4, 7)
    run(s, mk("a", ids))
    b = mk("b", ids)
    assert s.add(b)
    batch = step(s)
    assert batch is not None and batch.reqs == [b]
    assert (b.cached_tokens, b.num_shared_pages) == (28, 7)
    assert batch.prefix_lens == [28] and batch.extend_lens == [2]
    assert window_first_page(28, W, PS) == 4
    cached = swa(s).match_window(ids[:-1])
    assert np.array_equal(b.pages[:7], cached.pages) and np.array_equal(b.swa_pages[4:7], cached.swa_pages[4:7])
    run(s)
    assert b.finished and s.prefix_hit_tokens == 28


def test_a_shared_system_prompt_hits_from_the_third_request_on():
    s = make(chunk=8)
    rnd = random.Random(1)
    system = [rnd.randrange(3, 90) for _ in range(20)]  # 5 pages
    reqs = [mk(f"r{i}", system + [rnd.randrange(3, 90) for _ in range(rnd.randint(6, 12))]) for i in range(4)]
    for r in reqs:
        run(s, r)
    # the first's prompt end lies past the system prompt, so the window before 20 slid out of it;
    # the second matched 20 tokens of full pages without their window and kept the window there
    assert [r.cached_tokens for r in reqs] == [0, 0, 20, 20]
    assert 20 in reqs[1].swa_hit_points


def test_each_turn_of_a_conversation_hits_the_last():
    s = make(chunk=8)
    rnd = random.Random(2)
    convo = [rnd.randrange(3, 90) for _ in range(26)]
    hits = []
    for turn in range(4):
        r = mk(f"t{turn}", convo, max_new=6)
        run(s, r)
        hits.append(r.cached_tokens)
        # the previous turn cached its full pages up to its last KV: prompt + 5 outputs
        convo = r.all_ids + [rnd.randrange(3, 90) for _ in range(5)]
    assert hits[0] == 0 and all(h > 0 and h % PS == 0 for h in hits[1:]), hits
    for h, n in zip(hits[1:], [26, 37, 48]):
        assert h == (n + 5) // PS * PS  # the previous turn's num_cached, page aligned


def test_an_abort_inserts_nothing_and_frees_every_page():
    s = make(chunk=6)
    start = s.allocator.num_free
    r = mk("doomed", list(range(3, 40)), max_new=20)
    assert s.add(r)
    while len(r.output_ids) < 8:
        assert step(s) is not None
    s.abort(r.rid)
    assert swa(s).num_pages == swa(s).num_swa_pages == 0 and s.allocator.num_free == start
    # with a hit: the cache keeps what it had, the lock goes, nothing new comes in
    run(s, mk("a", list(range(3, 40))))
    before = (swa(s).num_pages, swa(s).num_swa_pages, s.allocator.num_free)
    h = mk("hit", list(range(3, 40)) + [7] * 9, max_new=20)
    assert s.add(h)
    while len(h.output_ids) < 3:
        assert step(s) is not None
    assert h.num_shared_pages > 0 and swa(s).locked_pages > 0
    s.abort(h.rid)
    assert (swa(s).num_pages, swa(s).num_swa_pages, s.allocator.num_free) == before
    assert swa(s).locked_pages == swa(s).locked_swa_pages == 0


def test_the_cache_s_pages_stay_pinned_while_read():
    s = make()
    ids = list(range(3, 43))
    run(s, mk("a", ids))
    r = mk("b", ids + [5] * 6, max_new=10)
    assert s.add(r)
    step(s)
    assert r.num_shared_pages > 0
    pinned = set(r.pages[: r.num_shared_pages].tolist()) | set(
        r.swa_pages[: r.num_shared_pages][r.swa_pages[: r.num_shared_pages] >= 0].tolist()
    )
    s.allocator.free(swa(s).evict(10_000))  # everything that is not pinned
    assert pinned <= set(swa(s).all_pages().tolist())
    check(s)
    run(s)
    assert r.finish_reason is FinishReason.LENGTH


def test_eviction_under_pressure_keeps_every_page_accounted_for():
    s = make(pages=40, chunk=8, running=3)
    rnd = random.Random(3)
    systems = [[rnd.randrange(3, 90) for _ in range(rnd.randint(10, 30))] for _ in range(3)]
    reqs = [
        mk(f"r{i}", rnd.choice(systems) + [rnd.randrange(3, 90) for _ in range(rnd.randint(1, 20))], rnd.randint(1, 9))
        for i in range(30)
    ]
    run(s, *reqs)
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert sum(r.cached_tokens for r in reqs) > 0
    s.allocator.free(swa(s).evict(10_000))
    assert s.allocator.num_free == 40 and swa(s).num_pages == swa(s).num_swa_pages == 0


def test_a_pd_decode_reserves_only_the_window_pages_it_lacks():
    s = make()
    ids = list(range(3, 33))
    run(s, mk("a", ids, max_new=1))  # as a decode that received 30 tokens: full pages 0..6 cached
    d = mk("d", ids + [9] * 6, max_new=5)  # 36 tokens; the cache gives 28 (7 pages)
    assert s.reserve(d)
    assert d.num_shared_pages == 7 and d.pages.size == 9
    lo = window_first_page(36, W, PS)  # the first decode query (36) sees from page 6 on
    assert lo == 6
    # the cache's window before its 28 tokens ([4, 7), more than the decode needs), then its own
    assert d.swa_pages[:7].tolist() == swa(s).match_window(ids[:-1]).swa_pages.tolist()
    assert (d.swa_pages[4:] >= 0).all() and (d.swa_pages[:4] < 0).all()
    check(s)
    d.output_ids.append(7)
    s.add_prefilled(d)
    run(s)
    assert d.finished


def test_only_an_swa_cache_goes_with_a_window():
    with pytest.raises(ValueError, match="SWARadixCache"):
        Scheduler(SchedulerConfig(), PageAllocator(8), PS, 64, prefix_cache=RadixCache(PS), window=W)
    with pytest.raises(ValueError, match="SWARadixCache"):
        Scheduler(SchedulerConfig(), PageAllocator(8), PS, 64, prefix_cache=SWARadixCache(PS, W))
