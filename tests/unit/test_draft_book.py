"""The STANDALONE drafter's bookkeeping (engine/spec/draft_book.py): which positions of a request's draft
KV stay valid after a verify step (the accepted drafts' do, a rejected draft's and everything after
it do not; never the last token, whose logits give the first draft), the catch-up each step runs,
the draft pages that cover it, no drafts when the draft pool is full, and every page back at release."""

from __future__ import annotations

import pytest

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.engine.spec.draft_book import DraftBook

PS = 4


def book(pages: int = 16) -> DraftBook:
    return DraftBook(PageAllocator(pages), PS)


@pytest.mark.parametrize(
    ("recorded", "tokens", "want"),
    [
        ([], [5, 6, 7], 0),
        ([5, 6], [5, 6, 7], 2),
        ([5, 6, 7], [5, 6, 7], 2),  # the last token is always forwarded again
        ([5, 6, 9, 10], [5, 6, 7, 8, 11], 2),  # a rejected draft at position 2
        ([5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 3], 5),
        ([1], [5], 0),
    ],
)
def test_valid_len_is_the_common_prefix_before_the_last_token(recorded, tokens, want):
    assert DraftBook.valid_len(recorded, tokens) == want


def test_first_step_catches_up_on_the_whole_prompt_and_covers_the_chain():
    b = book()
    prompt = list(range(10, 19))  # 9 tokens and the first output token
    tokens = prompt + [40]
    plan = b.plan("r", tokens, 3)
    assert plan is not None and plan.start == 0 and plan.catch_up == tokens
    # the catch-up writes 10 positions, the chain drafts 1 and 2 two more: 12 positions, 3 pages
    assert len(plan.pages) == 3 and b.allocator.num_free == 13 and b.num_used_pages == 3


def test_after_a_verify_step_only_the_rejected_part_is_recomputed():
    b = book()
    tokens = list(range(20, 30))  # 10 tokens
    b.plan("r", tokens, 4)
    d = [70, 71, 72, 73]
    b.wrote("r", tokens)
    b.wrote("r", d[:3])  # the chain feeds drafts 1..3 back; draft 4 is never forwarded
    # two drafts accepted, then the target's bonus token (not draft 3)
    nxt = tokens + [70, 71, 99]
    plan = b.plan("r", nxt, 4)
    assert plan is not None and plan.start == 12 and plan.catch_up == [99]
    assert b.seqs["r"].tokens == nxt[:12]  # what the rejected draft 3 left is forgotten
    # every draft accepted: drafts 1..3 have KV, draft 4 and the bonus are caught up on
    b.wrote("r", [99, 80, 81, 82])
    nxt2 = nxt + [80, 81, 82, 83, 84]
    plan = b.plan("r", nxt2, 2)
    assert plan is not None and plan.start == 16 and plan.catch_up == [83, 84]
    # nothing accepted: the bonus token alone
    b.wrote("r", [83, 84, 60])
    plan = b.plan("r", nxt2 + [61], 2)
    assert plan is not None and plan.start == len(nxt2) and plan.catch_up == [61]


def test_no_room_means_no_drafts_and_nothing_changes():
    b = book(pages=3)
    assert b.plan("a", list(range(8)), 2) is not None  # 9 positions: 3 pages
    assert b.allocator.num_free == 0
    b.wrote("a", list(range(8)))
    assert b.plan("b", [1, 2, 3], 2) is None and b.seqs["b"].tokens == []
    assert b.plan("a", list(range(8)) + [50, 51, 52, 53, 54], 3) is None  # would need a 4th page
    assert b.seqs["a"].tokens == list(range(8))
    b.release("a")
    assert b.allocator.num_free == 3
    assert b.plan("b", [1, 2, 3], 2) is not None


def test_release_frees_every_page_once():
    b = book()
    for rid in ("a", "b"):
        b.plan(rid, list(range(9)), 4)
    assert b.allocator.num_free == 16 - 6
    b.release("a")
    b.release("a")  # idempotent: a held request is forgotten twice
    b.release("never-seen")
    b.release("b")
    assert b.allocator.num_free == 16 and b.num_used_pages == 0 and not b.seqs


def test_no_drafts_asked_plans_nothing():
    b = book()
    assert b.plan("r", [1, 2, 3], 0) is None and b.allocator.num_free == 16


def test_pd_reserves_the_prompt_and_takes_landed_draft_kv_as_written():
    """PD: the prompt's pages up front (none when they do not fit); once its draft KV landed
    (`wrote` the prompt) the first step extends the draft over the first output token only, in
    the reserved pages and what the chain needs past them."""
    b = book(pages=8)
    prompt = list(range(10, 19))  # 9 tokens: 3 pages
    pages = b.reserve("r", 3)
    assert pages.size == 3 and b.allocator.num_free == 5
    assert b.reserve("r", 3).tolist() == pages.tolist()  # again: the same pages, nothing allocated
    b.wrote("r", prompt)
    plan = b.plan("r", prompt + [40], 3)
    assert plan is not None and (plan.start, plan.catch_up) == (9, [40])
    assert plan.pages[:3].tolist() == pages.tolist() and plan.pages.size == 3  # 9 + 1 + 2 tokens: 3 pages
    assert b.reserve("big", 6).size == 0 and b.allocator.num_free == 5  # no room: nothing taken
    b.release("r")
    b.release("big")
    assert b.allocator.num_free == 8 and not b.seqs
