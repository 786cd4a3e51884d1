"""The scheduler with a sliding-window prefix cache (SWARadixCache, no model): a repeated prompt,
a shared system prompt (a hit from the third request on: the second keeps the window where its
match outran the windows) and a multi-turn conversation hit, the hit restores the request's window
page table from the cache's pages and computes only the rest; an abort inserts nothing and frees
everything; the cache's pages stay pinned while a request reads them; a PD decode hits its
full-layer match (a shared system prompt from the second request on) and reserves, as its own,
the pages of the prompt's last window the cache lacks, below its prefix too; and every page of
either kind is the cache's or one request's own after every step, also under eviction pressure."""

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
from kvpipe.engine.window_cache import own_window_mask, own_window_pages, wanted_window_pages

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
    own = [r.pages[r.num_shared_pages :] for r in owners] + [own_window_pages(r) for r in owners]
    held = cache.all_pages()
    allp = np.concatenate([held, *own])
    assert np.unique(allp).size == allp.size == s.allocator.num_used
    s.allocator.check_owned(allp)
    for r in s.running + list(s.reserved.values()):
        shared = r.swa_pages[~own_window_mask(r)]
        assert set(shared[shared >= 0].tolist()) <= set(held.tolist())
    for r in s.running:
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


def decode(s: Scheduler, r: Req) -> None:
    """As a PD decode: reserve r's pages, its KV and first token arrive, it decodes to its end."""
    assert s.reserve(r)
    check(s)
    r.output_ids.append(7)
    s.add_prefilled(r)
    run(s)
    assert r.finish_reason is FinishReason.LENGTH


def test_a_pd_decode_reserves_only_the_window_pages_it_lacks():
    s = make()
    ids = list(range(3, 33))
    run(s, mk("a", ids, max_new=1))  # as a decode that received 30 tokens: full pages 0..6 cached
    d = mk("d", ids + [9] * 6, max_new=5)  # 36 tokens; the cache gives 28 (7 pages)
    assert s.reserve(d)
    assert d.num_shared_pages == 7 and d.pages.size == 9
    lo = window_first_page(36, W, PS)  # the first decode query (36) sees from page 6 on
    assert lo == 6
    # the cache's window page 6 (it holds [4, 7): a's window before 28), its own from 7 on; none before 6
    cached = swa(s).match_window(ids[:-1]).swa_pages
    assert d.swa_pages[6] == cached[6] >= 0 and (d.swa_pages[:6] < 0).all() and (d.swa_pages[7:] >= 0).all()
    assert d.swa_own_shared.size == 0 and wanted_window_pages(d).tolist() == d.swa_pages[7:].tolist()
    check(s)
    d.output_ids.append(7)
    s.add_prefilled(d)
    run(s)
    assert d.finished


def test_a_pd_decode_hits_a_shared_system_prompt_and_owns_the_window_pages_the_cache_lacks():
    """The decode's cache holds a system prompt's full pages without their window pages (they slid
    out of the request that cached it): the next prompt hits its full pages, owns the pages of its
    last window before the hit, which the writer fills, and fills the cache's tombstones at finish;
    the one after takes them from the cache."""
    s = make()
    rnd = random.Random(5)
    system = [rnd.randrange(3, 90) for _ in range(20)]  # 5 pages
    tail = lambda n: [rnd.randrange(3, 90) for _ in range(n)]  # noqa: E731
    decode(s, mk("r0", system + tail(12), max_new=2))  # window of 32: [5, 8); the system's window slid out
    assert swa(s).match_window(system).pages.size == 0  # a colocated hit there would need them
    r1 = mk("r1", system + tail(3), max_new=2)  # 23 tokens: its last window is [3, 6)
    assert s.reserve(r1)
    assert r1.num_shared_pages == 5 and r1.swa_own_shared.tolist() == [3, 4]
    assert (r1.swa_pages[3:6] >= 0).all() and (r1.swa_pages[:3] < 0).all()
    # the writer fills logical pages 3..5: 2 before the prefix, then the one after it
    assert wanted_window_pages(r1).tolist() == r1.swa_pages[3:6].tolist()
    below = r1.swa_pages[3:5].tolist()
    check(s)
    r1.output_ids.append(7)
    s.add_prefilled(r1)
    run(s)
    # the cache took r1's window pages before its prefix into its tombstones
    _, node = swa(s).match(system)
    assert swa(s).path_window_pages(node)[3:5].tolist() == below
    r2 = mk("r2", system + tail(5), max_new=3)  # 25 tokens: its last window is [4, 7)
    assert s.reserve(r2)
    assert r2.num_shared_pages == 5 and r2.swa_own_shared.size == 0 and r2.swa_pages[4] == below[1]
    assert wanted_window_pages(r2).tolist() == r2.swa_pages[5:7].tolist()  # from the prefix on only
    check(s)
    r2.output_ids.append(7)
    s.add_prefilled(r2)
    run(s)
    assert s.prefix_hit_tokens == 40
    s.allocator.free(swa(s).evict(10_000))
    assert s.allocator.num_free == s.allocator.num_pages


def test_an_aborted_pd_decode_frees_its_own_window_pages_below_its_prefix():
    s = make()
    system = list(range(3, 23))
    decode(s, mk("r0", system + [50] * 12, max_new=2))
    before = (swa(s).num_pages, swa(s).num_swa_pages, s.allocator.num_free)
    r = mk("r1", system + [60] * 3, max_new=4)
    assert s.reserve(r)
    assert r.swa_own_shared.tolist() == [3, 4] and swa(s).locked_pages > 0
    check(s)
    s.abort(r.rid)  # its KV never arrived: nothing goes to the cache, every own page is free
    assert (swa(s).num_pages, swa(s).num_swa_pages, s.allocator.num_free) == before
    assert swa(s).locked_pages == swa(s).locked_swa_pages == 0


def test_pd_decodes_under_eviction_pressure_keep_every_page_accounted_for():
    s = make(pages=48, running=2)
    rnd = random.Random(6)
    systems = [[rnd.randrange(3, 90) for _ in range(rnd.randint(8, 24))] for _ in range(3)]
    inserted = 0
    for i in range(30):
        r = mk(f"d{i}", rnd.choice(systems) + [rnd.randrange(3, 90) for _ in range(rnd.randint(1, 14))], 1 + i % 5)
        decode(s, r)
        inserted += (r.seq_len - 1) // PS
    # hits, and more full pages went in than the pool holds: eviction ran
    assert s.prefix_hit_tokens > 0 and inserted > 48
    s.allocator.free(swa(s).evict(10_000))
    assert s.allocator.num_free == 48 and swa(s).num_pages == swa(s).num_swa_pages == 0


def test_only_an_swa_cache_goes_with_a_window():
    with pytest.raises(ValueError, match="SWARadixCache"):
        Scheduler(SchedulerConfig(), PageAllocator(8), PS, 64, prefix_cache=RadixCache(PS), window=W)
    with pytest.raises(ValueError, match="SWARadixCache"):
        Scheduler(SchedulerConfig(), PageAllocator(8), PS, 64, prefix_cache=SWARadixCache(PS, W))
