"""A hybrid draft model's state slots (engine/spec/draft_state.py): two per request, allocated on first
use and given back once; none when the pool is full (the request then gets no drafts); and the
draft book's catch-up never starts past what the base state has seen."""

from __future__ import annotations

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.engine.spec.draft_book import DraftBook
from kvpipe.engine.spec.draft_state import DraftStates


def test_two_slots_per_request_given_back_once():
    states = DraftStates(2)
    a, b = states.get("a"), states.get("b")
    assert a is not None and b is not None and states.get("a") is a
    assert len({a.base, a.work, b.base, b.work}) == 4
    assert states.get("c") is None and states.slots.num_free == 0  # full: no drafts for "c"
    a.base_len = 7
    assert states.base_len("a") == 7 and states.base_len("c") == 0
    states.release("a")
    states.release("a")  # idempotent
    assert states.slots.num_free == 2 and states.get("c") is not None
    states.release("b")
    states.release("c")
    assert states.slots.in_use() == {}


def test_catch_up_starts_at_the_base_state():
    """The draft KV of a chain's drafts matches the accepted ones (valid_len past the base), but a
    hybrid draft's base state saw only the true tokens: the catch-up starts there."""
    book = DraftBook(PageAllocator(8), 4)
    plan = book.plan("r", [1, 2, 3], 3, max_start=0)
    assert plan is not None and plan.start == 0 and plan.catch_up == [1, 2, 3]
    book.wrote("r", [1, 2, 3, 9, 8])  # catch-up, then drafts 9 and 8 fed back
    tokens = [1, 2, 3, 9, 8, 5]  # both accepted, then the bonus token
    plan = book.plan("r", tokens, 3)
    assert plan is not None and plan.start == 5
    book.wrote("r", plan.catch_up)
    plan = book.plan("r", tokens + [6], 3, max_start=3)
    assert plan is not None and plan.start == 3 and plan.catch_up == [9, 8, 5, 6]
