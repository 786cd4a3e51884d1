"""--enable-mixed-chunk: a step that prefills also carries one token of every decoding request
(ForwardMode.MIXED), their tokens counted against the step's budget; pages stay exact."""

from __future__ import annotations

import random

import pytest

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.recurrent_slots import StateSlotAllocator
from kvpipe.config import SchedulerConfig
from kvpipe.engine.batch import ForwardMode
from kvpipe.engine.request import FinishReason
from kvpipe.engine.scheduler import Scheduler
from tests.helpers.scheduler_steps import drain, random_load, req, step


def make(num_pages: int = 64, page_size: int = 4, mixed: bool = True, **cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), PageAllocator(num_pages), page_size, 4096, mixed_chunk=mixed)


def test_decoders_ride_along_prefill_chunks() -> None:
    s = make(chunked_prefill_size=8, max_prefill_tokens=100)
    a, b = req("a", 5, max_new=6), req("b", 20, max_new=2)
    s.add(a)
    first = step(s)
    assert first is not None and first.mode is ForwardMode.PREFILL  # nothing decodes yet: a plain prefill
    s.add(b)
    mixed = step(s)
    assert mixed is not None and mixed.mode is ForwardMode.MIXED
    # prompt rows first, then the decoder; its token comes out of the budget of 8
    assert [r.rid for r in mixed.reqs] == ["b", "a"]
    assert mixed.extend_lens == [7, 1] and mixed.prefix_lens == [0, 5]
    assert [mixed.is_prompt_row(i) for i in range(2)] == [True, False]
    assert [mixed.completes_prefill(i) for i in range(2)] == [False, True]
    assert len(a.output_ids) == 2  # a advanced during b's chunk
    rest = drain(s)
    # b's prompt (13 tokens left) takes two more MIXED steps with a beside it, then plain decodes
    assert [x.mode for x in rest[:2]] == [ForwardMode.MIXED] * 2
    assert all(x.mode is ForwardMode.DECODE for x in rest[2:])
    assert a.output_ids == [5, 6, 7, 8, 9, 10] and b.output_ids == [20, 21]
    assert s.allocator.num_free == 64


def test_off_keeps_prefill_and_decode_apart() -> None:
    s = make(mixed=False, chunked_prefill_size=8, max_prefill_tokens=100)
    s.add(req("a", 5, max_new=6))
    step(s)
    s.add(req("b", 20, max_new=2))
    assert all(x.mode is not ForwardMode.MIXED for x in drain(s))


def test_a_step_with_nothing_to_prefill_is_a_plain_decode() -> None:
    s = make(chunked_prefill_size=8, max_prefill_tokens=100)
    s.add(req("a", 5, max_new=3))
    step(s)
    b = step(s)
    assert b is not None and b.mode is ForwardMode.DECODE and b.extend_lens == [1]


def test_decoders_take_the_budget_but_a_prompt_row_gets_a_token() -> None:
    s = make(num_pages=200, chunked_prefill_size=4, max_prefill_tokens=100, max_running_requests=10)
    for i in range(5):
        s.add(req(f"d{i}", 2, max_new=50))
    while any(not r.prefill_done for r in s.running) or s.waiting:  # all five decode
        step(s)
    s.add(req("p", 9, max_new=1))
    b = step(s)
    assert b is not None and b.mode is ForwardMode.MIXED
    assert b.extend_lens == [1] * 6  # budget 4 - 5 decoders: one prompt token, then the five
    assert b.reqs[0].rid == "p" and b.is_prompt_row(0)


def test_refuses_a_drafter_and_recurrent_state() -> None:
    with pytest.raises(ValueError, match="mixed"):
        Scheduler(SchedulerConfig(), PageAllocator(8), 4, 64, drafter=lambda r, k: [], mixed_chunk=True)
    with pytest.raises(ValueError, match="mixed"):
        Scheduler(SchedulerConfig(), PageAllocator(8), 4, 64, state_slots=StateSlotAllocator(2), mixed_chunk=True)


def test_random_load_with_aborts_returns_every_page() -> None:
    rnd = random.Random(1)
    s = make(num_pages=40, chunked_prefill_size=rnd.choice([5, 16]), max_prefill_tokens=24, max_running_requests=8)
    reqs, batches = random_load(s, rnd)
    assert all(b.num_tokens <= max(24, 16) + len(b.reqs) for b in batches)
    assert ForwardMode.MIXED in {b.mode for b in batches}
    assert all(r.finished for r in reqs) and any(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert s.allocator.num_free == 40
