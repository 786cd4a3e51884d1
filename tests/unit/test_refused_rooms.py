"""The prefill's book of rooms decodes refused (disagg/refusals.py): each refusal acted on once,
whether it comes before the request, between its claim and its admission, or while it runs;
forgotten after its TTL; counted by reason; the message the prefill gives. No sockets."""

from __future__ import annotations

import dataclasses

from kvpipe.disagg.refusals import RefusedRooms, refusal_reason
from kvpipe.transfer.control.handshake import REFUSED, Handshake, RefusalNotice
from tests.helpers.bootstrap_info import layout

MINE = Handshake.of("a" * 64, layout())


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


C = {room: room.to_bytes(16, "little") for room in range(20)}  # each room's request's claim


def test_each_refused_room_is_taken_once_and_popped_once():
    book = RefusedRooms(ttl_s=5.0, clock=Clock())
    book.add([7, 8], "why", "page_size", [C[7], C[8]])
    assert book.take_new() == [7, 8] and book.take_new() == []
    assert book.pop(7, C[7]) == "why" and book.pop(7, C[7]) is None
    assert book.pop(9, C[9]) is None
    assert book.snapshot() == {"page_size": 2}


def test_a_refusal_counts_only_for_the_request_whose_claim_it_names():
    """Issue 45: a token holder who knows a room id posts a notice for it; the request is not
    failed (its claim is not the notice's, or the notice names none)."""
    book = RefusedRooms(ttl_s=5.0, clock=Clock())
    book.add([7, 8], "forged", "page_size", [C[9], None])
    assert book.pop(7, C[7]) is None and book.pop(8, C[8]) is None


def test_refusals_expire_and_the_book_stays_bounded():
    clock = Clock()
    book = RefusedRooms(ttl_s=5.0, max_rooms=3, clock=clock)
    book.add([1], "old", "model", [C[1]])
    clock.t = 6.0
    assert book.pop(1, C[1]) is None  # its request never came in time
    book.add(range(10, 15), "new", "kv_dtype", [C[r] for r in range(10, 15)])
    assert [book.pop(r, C[r]) for r in range(10, 15)] == [None, None, "new", "new", "new"]  # oldest forgotten
    assert book.take_new() == [12, 13, 14]  # bounded too: the newest
    assert book.snapshot() == {"model": 1, "kv_dtype": 5}


def test_the_prefill_names_both_sides_itself_when_the_decode_sent_its_handshake():
    theirs = dataclasses.replace(MINE, page_size=64)
    reason, label = refusal_reason(RefusalNotice((1,), "decode's words", "page_size", theirs), MINE)
    assert (reason, label) == (f"{REFUSED}: page size: prefill 4, decode 64", "page_size")


def test_otherwise_the_decodes_words_marked_as_a_refusal():
    n = RefusalNotice((1,), "served model name differs", "model_name")
    assert refusal_reason(n, MINE) == (f"{REFUSED} by the decode: served model name differs", "model_name")
    marked = RefusalNotice((1,), f"{REFUSED}: TP mapping", "tp", MINE)  # same handshakes: not the cause
    assert refusal_reason(marked, MINE) == (f"{REFUSED}: TP mapping", "tp")
