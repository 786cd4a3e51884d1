"""The scheduler's state slots (hybrid models): one per admitted request, taken at admission,
given back with its pages (finish, abort, release of held pages); a request that finds no free
slot waits in FIFO order like one that finds no pages."""

from __future__ import annotations

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.recurrent_slots import StateSlotAllocator
from kvpipe.config import SchedulerConfig
from kvpipe.engine.request import FinishReason
from kvpipe.engine.scheduler import Scheduler
from tests.helpers.scheduler_steps import drain, req, step


def make(slots: int, num_pages: int = 64, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), PageAllocator(num_pages), 4, 4096, state_slots=StateSlotAllocator(slots))


def live_slots(s: Scheduler) -> dict[int, str]:
    return {
        r.state_slot: r.rid
        for r in s.running + list(s.reserved.values()) + list(s.held.values())
        if r.state_slot is not None
    }


def test_slots_follow_requests_and_come_back():
    s = make(slots=2)
    for i in range(5):
        s.add(req(f"r{i}", 3 + i, max_new=3))
    seen_running = 0
    while s.has_work():
        b = s.schedule()
        # every running request holds its own slot, and the spec carries them row by row
        assert live_slots(s) == s.state_slots.in_use()
        assert b.spec(4).state_slots == tuple(r.state_slot for r in b.reqs) and None not in b.spec(4).state_slots
        seen_running = max(seen_running, len(s.running))
        toks = [r.seq_len if b.completes_prefill(i) else None for i, r in enumerate(b.reqs)]
        s.commit(b, toks, [0.0 if t is not None else None for t in toks])
        for r, t in zip(b.reqs, toks):
            if t is not None and len(r.output_ids) >= r.params.max_new_tokens:
                s.finish(r, FinishReason.LENGTH)
    assert seen_running == 2  # the third request waited for a slot although pages were free
    assert s.state_slots.in_use() == {} and s.state_slots.num_free == 2
    assert s.allocator.num_free == 64


def test_waiting_for_a_slot_keeps_fifo_order():
    s = make(slots=1, chunked_prefill_size=0)
    a, b = req("a", 4, max_new=2), req("b", 2, max_new=2)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert [r.rid for r in first.reqs] == ["a"] and b.state_slot is None and list(s.waiting) == [b]
    drain(s)
    assert a.output_ids and b.output_ids and s.state_slots.num_free == 1


def test_abort_and_held_pages_free_the_slot_once():
    s = make(slots=3)
    a, b, c = req("a", 6), req("b", 6), req("c", 6)
    for r in (a, b, c):
        s.add(r)
    step(s)
    assert len(s.state_slots.in_use()) == 3
    s.abort("a")
    assert a.state_slot is None and len(s.state_slots.in_use()) == 2
    s.finish(b, FinishReason.ABORT, "x", hold=True)  # a transfer keeps its pages: and its slot
    assert s.state_slots.owner(b.state_slot) == "b"
    assert s.release("b") and b.state_slot is None
    s.abort("c")
    s.abort("c")  # idempotent: no double free
    assert s.state_slots.in_use() == {} and s.allocator.num_free == 64


def test_reserve_needs_a_slot():
    s = make(slots=1)
    x, y = req("x", 5), req("y", 5)
    assert s.reserve(x) and x.state_slot == 0
    assert not s.reserve(y) and not y.finished and y.state_slot is None
    s.abort("x")
    assert s.reserve(y) and y.state_slot == 0
