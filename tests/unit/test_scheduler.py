import random

import numpy as np
import pytest

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.config import SchedulerConfig
from kvpipe.engine.batch import ForwardMode
from kvpipe.engine.request import FinishReason, Req, ReqStatus, SamplingParams
from kvpipe.engine.scheduler import Scheduler
from tests.helpers.scheduler_steps import drain, random_load, req, step


def make(num_pages=64, page_size=4, ctx=4096, whole=False, **cfg):
    return Scheduler(SchedulerConfig(**cfg), PageAllocator(num_pages), page_size, ctx, whole_prompt_pages=whole)


def test_single_request_prefill_then_decode():
    s = make(page_size=4)
    r = req("a", 10, max_new=5)
    assert s.add(r)
    bs = drain(s)
    assert [b.mode for b in bs] == [ForwardMode.PREFILL] + [ForwardMode.DECODE] * 4
    assert bs[0].extend_lens == [10] and bs[0].prefix_lens == [0]
    assert [b.prefix_lens[0] for b in bs[1:]] == [10, 11, 12, 13]
    assert r.output_ids == [10, 11, 12, 13, 14]
    assert r.finish_reason is FinishReason.LENGTH and r.status is ReqStatus.FINISHED
    assert s.allocator.num_free == 64 and r.pages.size == 0


@pytest.mark.parametrize("chunk", [7, 33, 64, 100])
def test_chunked_prefill_spans_steps(chunk):
    s = make(page_size=16, chunked_prefill_size=chunk, max_prefill_tokens=10_000)
    r = req("a", 150, max_new=2)
    s.add(r)
    bs = drain(s)
    pre = [b for b in bs if b.mode is ForwardMode.PREFILL]
    sizes = [b.extend_lens[0] for b in pre]
    assert sum(sizes) == 150 and all(n <= chunk for n in sizes)
    assert [b.prefix_lens[0] for b in pre] == list(np.cumsum([0] + sizes[:-1]))
    assert [b.completes_prefill(0) for b in pre] == [False] * (len(pre) - 1) + [True]
    assert r.output_ids == [150, 151]
    assert s.allocator.num_free == 64


def test_prefill_budget_and_fifo():
    s = make(chunked_prefill_size=0, max_prefill_tokens=25)
    for i in range(5):
        s.add(req(f"r{i}", 10))
    b = s.schedule()
    # whole prompts only: two fit the budget of 25, the third waits (FIFO)
    assert [r.rid for r in b.reqs] == ["r0", "r1"]
    assert [r.rid for r in s.waiting] == ["r2", "r3", "r4"]


def test_prompt_longer_than_budget_runs_alone_without_chunking():
    s = make(num_pages=200, chunked_prefill_size=0, max_prefill_tokens=8)
    s.add(req("big", 30))
    s.add(req("small", 3))
    b = s.schedule()
    assert [r.rid for r in b.reqs] == ["big"] and b.extend_lens == [30]


def test_chunking_fills_budget_with_partial_last_row():
    s = make(num_pages=200, chunked_prefill_size=16, max_prefill_tokens=1000)
    s.add(req("a", 10))
    s.add(req("b", 10))
    b = s.schedule()
    assert [r.rid for r in b.reqs] == ["a", "b"] and b.extend_lens == [10, 6]
    s.commit(b, [1, None], [0.0, None])
    b2 = s.schedule()  # a is decoding now and the last step was a prefill: decode first
    assert b2.mode is ForwardMode.DECODE and [r.rid for r in b2.reqs] == ["a"]
    s.commit(b2, [2], [0.0])
    b3 = s.schedule()
    assert [r.rid for r in b3.reqs] == ["b"] and (b3.prefix_lens, b3.extend_lens) == ([6], [4])


def test_prefill_and_decode_alternate():
    s = make(num_pages=200, chunked_prefill_size=5, max_prefill_tokens=5)
    s.add(req("a", 3, max_new=50))
    step(s)
    s.add(req("b", 20, max_new=2))
    modes = [step(s).mode for _ in range(8)]
    P, D = ForwardMode.PREFILL, ForwardMode.DECODE
    assert modes == [D, P, D, P, D, P, D, P]


def test_exhaustion_queues_then_runs():
    # each request needs ceil((8 + 8 - 1) / 4) = 4 pages; 10 pages fit two at a time
    s = make(num_pages=10, page_size=4)
    reqs = [req(f"r{i}", 8, max_new=8) for i in range(6)]
    for r in reqs:
        s.add(r)
    step(s)
    assert len(s.running) == 2 and len(s.waiting) == 4
    drain(s)
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 8 for r in reqs)
    assert s.allocator.num_free == 10


def test_never_fits_is_aborted_with_message():
    s = make(num_pages=4, page_size=4, ctx=64)
    too_big = req("big", 14, max_new=8)  # 21 KV tokens -> 6 pages > 4
    assert not s.add(too_big)
    assert too_big.finish_reason is FinishReason.ABORT and "KV cache" in too_big.finish_detail
    too_long = req("long", 60, max_new=8)
    assert not s.add(too_long)
    assert "context length" in too_long.finish_detail
    empty = Req("e", [], SamplingParams())
    assert not s.add(empty) and "empty" in empty.finish_detail
    assert not s.has_work() and s.allocator.num_free == 4


def test_abort_waiting_and_running_frees_once():
    s = make(num_pages=6, page_size=4)  # each needs ceil((8 + 8 - 1) / 4) = 4 pages
    a, b = req("a", 8, max_new=8), req("b", 8, max_new=8)
    s.add(a)
    s.add(b)
    step(s)
    assert a.status is ReqStatus.RUNNING and b.status is ReqStatus.WAITING
    assert s.abort("b") is b and b.finish_reason is FinishReason.ABORT
    assert s.abort("a", "client gone") is a and a.finish_detail == "client gone"
    assert s.abort("a") is None and s.abort("nope") is None
    s.finish(a, FinishReason.ABORT)  # idempotent: no double free
    assert s.allocator.num_free == 6 and not s.has_work()


def test_duplicate_rid_rejected():
    s = make()
    s.add(req("a", 3))
    with pytest.raises(ValueError):
        s.add(req("a", 3))


def test_whole_prompt_pages_at_the_first_chunk():
    """A PD prefill hands the whole page table to its transfer: every prompt page exists from
    the first chunk on, chunks still run in order, and admission accounting is unchanged."""
    s = make(num_pages=100, whole=True, chunked_prefill_size=7, max_prefill_tokens=7)
    r = req("a", 20, max_new=3)
    s.add(r)
    bs = drain(s)
    prefill = [(b.prefix_lens[0], b.prefix_lens[0] + b.extend_lens[0]) for b in bs if b.mode is ForwardMode.PREFILL]
    assert prefill == [(0, 7), (7, 14), (14, 20)]
    assert r.output_ids[0] == 20 and s.allocator.num_free == 100
    s2 = make(num_pages=100, whole=True, chunked_prefill_size=7, max_prefill_tokens=7)
    s2.add(req("b", 20, max_new=3))
    first = s2.schedule()
    assert first is not None and len(first.reqs[0].pages) == 5  # 20 tokens in pages of 4, not 7


def test_held_pages_until_release():
    s = make(num_pages=16)
    r = req("a", 10, max_new=1)
    s.add(r)
    drain(s, hold=True)
    assert r.finished and s.allocator.num_free == 13 and "a" in s.held
    assert s.stats()["num_held"] == 1
    assert s.release("a") and not s.release("a")
    assert s.allocator.num_free == 16 and r.pages.size == 0


def test_reserved_request_goes_straight_to_decode():
    s = make(num_pages=16, page_size=4)
    r = req("pd", 10, max_new=3)
    assert s.reserve(r) and r.pages.tolist() == [0, 1, 2]
    assert s.schedule() is None  # KV still arriving: nothing to run
    r.output_ids.append(77)
    s.add_prefilled(r)
    b = step(s)
    assert b.mode is ForwardMode.DECODE and b.prefix_lens == [10] and b.spec(4).token_ids == ([77],)
    drain(s)
    assert r.output_ids == [77, 11, 12] and s.allocator.num_free == 16


def test_reserve_abort_frees():
    s = make(num_pages=16, page_size=4)
    r = req("pd", 10, max_new=3)
    assert s.reserve(r)
    s.abort("pd")
    assert s.allocator.num_free == 16


def test_spec_tokens_and_page_tables():
    s = make(num_pages=32, page_size=4, chunked_prefill_size=6, max_prefill_tokens=6)
    r = req("a", 9, max_new=3)
    s.add(r)
    b = s.schedule()
    spec = b.spec(4)
    assert spec.token_ids == ([1, 2, 3, 4, 5, 6],) and spec.prefix_lens == (0,)
    assert spec.page_tables[0].tolist() == [0, 1] and spec.want_logits == (False,)


def test_200_mixed_requests_with_aborts_return_all_pages():
    rnd = random.Random(0)
    s = make(
        num_pages=40,
        page_size=4,
        chunked_prefill_size=rnd.choice([5, 16]),
        max_prefill_tokens=24,
        max_running_requests=8,
    )
    reqs, _ = random_load(s, rnd)
    assert all(r.finished for r in reqs)
    assert any(r.finish_reason is FinishReason.ABORT for r in reqs)
    assert any(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert s.allocator.num_free == 40


def test_reserve_waits_for_room_then_succeeds():
    s = make(num_pages=8, page_size=4)
    a, b = req("a", 8, max_new=8), req("b", 8, max_new=8)  # 4 pages each at most
    s.add(a)
    step(s)
    s.add(req("c", 8, max_new=8))
    assert s.reserve(b) and not s.reserve(req("d", 8, max_new=8))  # a and b hold all 8 promised pages
    assert step(s).mode is ForwardMode.DECODE  # the turn after a prefill
    assert step(s).mode is ForwardMode.DECODE  # c's turn, but nothing is left to promise it
    assert [r.rid for r in s.waiting] == ["c"] and not b.finished
    s.abort("b")
    assert step(s).mode is ForwardMode.PREFILL and not s.waiting


def test_max_running_requests_caps_admission():
    s = make(num_pages=100, max_running_requests=2)
    for i in range(4):
        s.add(req(f"r{i}", 3))
    b = s.schedule()
    assert [r.rid for r in b.reqs] == ["r0", "r1"] and len(s.waiting) == 2
    drain(s)
    assert s.allocator.num_free == 100


def cached(num_pages=16, page_size=4):
    return Scheduler(SchedulerConfig(), PageAllocator(num_pages), page_size, 4096, prefix_cache=RadixCache(page_size))


def test_reserve_with_a_prefix_cache_asks_only_for_the_missing_pages():
    """Decode side: reserve pins the cached prefix and allocates the rest; a reserved request's
    pages enter the cache only after add_prefilled (its KV verified), never after an abort."""
    s = cached()
    first = req("a", 10, max_new=2)  # tokens 1..10
    assert s.reserve(first) and first.num_shared_pages == 0
    first.output_ids.append(99)
    s.add_prefilled(first)
    drain(s)
    assert s.stats()["cached_pages"] == 2  # tokens 1..8 (tokens 9..11 fill a partial page)
    r = req("b", 13, max_new=2)  # shares tokens 1..8
    assert s.reserve(r)
    assert r.num_shared_pages == 2 and r.pages[:2].tolist() == s.cache.all_pages().tolist()[:2]
    assert r.pages.size == 4 and s.stats()["prefix_hit_tokens"] == 8
    assert s.cache.evictable_pages == 0  # pinned while its transfer runs
    s.finish(r, FinishReason.ABORT, "transfer failed", hold=True)  # its KV never arrived
    assert s.cache.evictable_pages == 0  # still pinned: the held request's writes may land
    s.release("b")
    assert s.stats()["cached_pages"] == 2 and s.allocator.num_free + s.cache.evictable_pages == 16
    again = req("c", 13, max_new=2)
    assert s.reserve(again) and again.num_shared_pages == 2
    again.output_ids.append(5)
    s.add_prefilled(again)
    s.finish(again, FinishReason.LENGTH)
    assert s.stats()["cached_pages"] == 3  # its verified third page joined (tokens 9..12)


def test_reserve_with_a_prefix_cache_waits_then_evicts():
    """A full pool of cached pages nobody reads is room for a reservation (LRU eviction)."""
    s = cached(num_pages=6)
    for i, n in enumerate((8, 8, 8)):
        r = Req(f"x{i}", [100 * (i + 1) + t for t in range(n)], SamplingParams(max_new_tokens=1))
        assert s.reserve(r)
        r.output_ids.append(1)
        s.add_prefilled(r)
        s.finish(r, FinishReason.LENGTH)
    assert s.allocator.num_free == 0 and s.cache.evictable_pages == 6
    big = req("big", 20, max_new=1)  # 5 pages: evicts 5 cached ones
    assert s.reserve(big) and big.num_shared_pages == 0 and big.pages.size == 5
    assert s.allocator.num_free + s.cache.evictable_pages == 1  # eviction goes by whole leaves
