"""The scheduler's sliding-window pages (GPT-OSS): a second page table per request from the same
allocator, allocated for what a step's queries can see, freed as the window slides past, and
promised at admission; a PD decode reserves the prompt's last window only."""

from __future__ import annotations

import numpy as np
import pytest

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.cache.window_pages import window_first_page, window_page_bound
from kvpipe.config import SchedulerConfig
from kvpipe.engine.request import FinishReason
from kvpipe.engine.scheduler import Scheduler
from tests.helpers.scheduler_steps import drain, req, step

PS, W = 4, 10


def make(num_pages: int = 64, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), PageAllocator(num_pages), PS, 4096, window=W)


def window_ok(r) -> None:
    """Live window pages are exactly those from the next query's window on, and distinct from
    the full layers' pages."""
    first = window_first_page(r.num_cached, W, PS)
    live = r.swa_pages[r.swa_pages >= 0]
    assert (r.swa_pages[:first] < 0).all() and (r.swa_pages[first:] >= 0).all()
    assert not set(live.tolist()) & set(r.pages.tolist())


def test_first_page_and_bound_arithmetic():
    # query 12 sees keys 3..12: page 0 (keys 0-3) is still needed; query 13 sees 4..13: page 1 on
    assert window_first_page(12, W, PS) == 0 and window_first_page(13, W, PS) == 1
    assert window_first_page(5, W, PS) == 0
    # keys p-9 .. p+n-1 span 9 + n tokens: at most cdiv(9 + n, 4) + 1 pages
    assert window_page_bound(W, 1, PS) == 4 and window_page_bound(W, 7, PS) == 5


@pytest.mark.parametrize("chunk", [0, 3, 8])
def test_window_pages_slide_and_stay_bounded(chunk):
    s = make(chunked_prefill_size=chunk)
    r = req("a", 23, max_new=40)
    s.add(r)
    bound = s.window_pages(r)
    worst = 0
    while s.has_work():
        b = step(s)
        if r.finished:
            break
        assert b is not None
        window_ok(r)
        live = int((r.swa_pages >= 0).sum())
        worst = max(worst, live)
        assert s.allocator.num_used == len(r.pages) + live
    assert 0 < worst <= bound
    assert s.allocator.num_free == 64 and r.swa_pages.size == 0


def test_spec_carries_the_window_tables_row_by_row():
    s = make(chunked_prefill_size=5)
    a, c = req("a", 13, max_new=3), req("c", 4, max_new=3)
    s.add(a)
    s.add(c)
    for _ in range(6):
        b = s.schedule()
        spec = b.spec(PS)
        for i, row in enumerate(b.reqs):
            used = -(-(b.prefix_lens[i] + b.extend_lens[i]) // PS)
            assert np.array_equal(spec.swa_page_tables[i], row.swa_pages[:used])
            # every token the step writes has a window page
            for pos in range(b.prefix_lens[i], b.prefix_lens[i] + b.extend_lens[i]):
                assert spec.swa_page_tables[i][pos // PS] >= 0
        toks = [r.seq_len if b.completes_prefill(i) else None for i, r in enumerate(b.reqs)]
        s.commit(b, toks, [0.0 if t is not None else None for t in toks])


def test_reserve_takes_the_prompt_s_last_window_only():
    s = make()
    r = req("d", 30, max_new=20)
    assert s.reserve(r)
    first = window_first_page(30, W, PS)  # the first decode query (position 30) sees keys 21..30
    assert first == 5
    assert (r.swa_pages[:first] < 0).all() and (r.swa_pages[first:] >= 0).all()
    assert r.swa_pages.size == r.pages.size == 8
    r.output_ids.append(7)
    s.add_prefilled(r)
    drain(s)
    assert r.finished and s.allocator.num_free == 64


def test_admission_counts_window_pages():
    # a 7-token prompt with 30 new tokens: 9 full pages (36 tokens) + a window of 5 pages: 14
    s = make(num_pages=14, chunked_prefill_size=0)
    a, b = req("a", 7, max_new=30), req("b", 7, max_new=30)
    s.add(a)
    s.add(b)
    assert s.max_pages(a) + s.window_pages(a) == 9 + window_page_bound(W, 7, PS) == 14
    first = s.schedule()
    assert first.reqs == [a] and list(s.waiting) == [b]  # b waits: a's promise covers the pool
    drain(s)
    assert b.finished and s.allocator.num_free == 14
    too_big = req("c", 7, max_new=34)  # 10 full + 5 window pages > 14
    assert not s.add(too_big) and too_big.finish_reason is FinishReason.ABORT
    assert "sliding window" in too_big.finish_detail


def test_abort_and_held_pages_free_window_pages_once():
    s = make(chunked_prefill_size=16)
    a, b = req("a", 18), req("b", 18)
    s.add(a)
    s.add(b)
    for _ in range(4):
        step(s)
    s.abort("a")
    s.abort("b", hold=True)
    assert b.swa_pages.size and (b.swa_pages >= 0).any()  # held with its pages
    assert s.release("b") and not s.release("b")
    assert s.allocator.num_free == 64


def test_a_prefix_cache_is_refused():
    with pytest.raises(ValueError, match="prefix cache"):
        Scheduler(SchedulerConfig(), PageAllocator(8), PS, 64, prefix_cache=RadixCache(PS), window=W)
