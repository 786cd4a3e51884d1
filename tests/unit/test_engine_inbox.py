"""The engine's inbox (engine/inbox.py): what other threads hand the engine thread."""

import threading

import pytest

from kvpipe.engine.inbox import Inbox
from kvpipe.engine.request import Req, SamplingParams


def _req(rid: str) -> Req:
    return Req(rid, [1, 2], SamplingParams(max_new_tokens=1))


def test_take_drains_requests_and_aborts_in_order():
    box = Inbox()
    box.add(_req("a"))
    box.add(_req("b"))
    box.abort("a")
    assert box.pending() and box.num_new() == 2
    new, aborts = box.take()
    assert [r.rid for r in new] == ["a", "b"] and aborts == ["a"]
    assert not box.pending() and box.take() == ([], [])


def test_an_active_rid_is_refused_until_released():
    box = Inbox()
    box.add(_req("a"))
    box.take()
    with pytest.raises(ValueError, match="already running"):
        box.add(_req("a"))
    box.release("a")
    box.add(_req("a"))


def test_a_refusing_claim_leaves_the_rid_free():
    box = Inbox()

    def claim(req: Req) -> None:
        raise ValueError("bootstrap_room missing")

    with pytest.raises(ValueError, match="bootstrap_room"):
        box.add(_req("a"), claim)
    box.add(_req("a"))  # the refused request took nothing
    assert box.num_new() == 1


def test_closed_refuses_new_requests_once():
    box = Inbox()
    assert box.close() and not box.close()
    with pytest.raises(RuntimeError, match="shut down"):
        box.add(_req("a"))


def test_adds_from_many_threads_all_arrive():
    box = Inbox()
    threads = [threading.Thread(target=lambda i=i: box.add(_req(f"r{i}"))) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    new, _ = box.take()
    assert sorted(r.rid for r in new) == sorted(f"r{i}" for i in range(16))
