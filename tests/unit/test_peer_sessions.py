"""Decode sessions and room claims without threads or sockets (issue 45, findings 3 and 6): the
prefill's challenge (sender/challenge.py), its session table's bounds, eviction and idleness
(sender/peers.py), claim groups (sender/claims.py), and the decode's side of registration
(receiver/registration.py), on explicit clock values with lists as the network."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvpipe.config import ControlLimits, DisaggregationConfig
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.bootstrap import PrefillInstanceInfo, PrefillRankInfo
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.receiver.book import ReceiverBook
from kvpipe.transfer.receiver.registration import MAX_CHALLENGES
from kvpipe.transfer.sender.book import SenderBook
from tests.helpers.registered import register_answered

L, PS, HD, PAGES = 2, 4, 8, 64
S = m.RegisterState
CFG = DisaggregationConfig(
    bootstrap_timeout_s=5, waiting_timeout_s=50, heartbeat_interval_s=1, heartbeat_misses=3, transfer_timeout_s=10
)
ADDR = ("prefill-host", 8998)


def layout(base: int) -> KVLayout:
    return KVLayout(L, PS, 2, 0, 2, HD, "float32", 4, tuple(base + i * (1 << 20) for i in range(2 * L)), PAGES * 256)


def reg(session: str, control: str = "tcp://d", data: str | None = None, base: int = 1 << 40) -> m.RegisterPeer:
    return m.RegisterPeer(session, 0, 1, data or f"data-{session}", control, layout(base))


class Prefill:
    def __init__(self, **limits: int) -> None:
        self.sent: list[tuple[str, object]] = []
        cfg = dataclasses.replace(CFG, limits=ControlLimits(**limits))
        self.book = SenderBook(cfg, layout(1 << 30), 0, 1, "p/0", lambda a, msg: self.sent.append((a, msg)) or True)

    def replies(self) -> list[tuple[str, m.RegisterState, str]]:
        out = [(msg.session_id, msg.state, a) for a, msg in self.sent if isinstance(msg, m.RegisterReply)]
        self.sent = [x for x in self.sent if not isinstance(x[1], m.RegisterReply)]
        return out


def test_a_registration_counts_only_with_its_challenge_answered() -> None:
    p = Prefill()
    first = reg("d/0")
    p.book.on_message(first, 0.0)
    [(a, challenge)] = [(a, msg) for a, msg in p.sent if isinstance(msg, m.RegisterReply)]
    assert a == "tcp://d" and challenge.state is S.CHALLENGE and p.book.peers.peers == {}  # to the named address
    p.sent.clear()
    for forged in (
        dataclasses.replace(first, challenge=b"x" * len(challenge.challenge)),
        dataclasses.replace(first, challenge=challenge.challenge, control_address="tcp://elsewhere"),
        dataclasses.replace(first, challenge=challenge.challenge, session_id="d/other"),
    ):
        p.book.on_message(forged, 1.0)  # another registration's, or made up: challenged again
    assert [st for _, st, _ in p.replies()] == [S.CHALLENGE] * 3 and p.book.peers.peers == {}
    p.book.on_message(dataclasses.replace(first, challenge=challenge.challenge), 31.0)  # stale
    assert [st for _, st, _ in p.replies()] == [S.CHALLENGE] and p.book.peers.peers == {}
    p.book.on_message(dataclasses.replace(first, challenge=challenge.challenge), 29.0)
    assert p.replies() == [("d/0", S.ACCEPTED, "tcp://d")] and list(p.book.peers.peers) == ["d/0"]
    assert p.book.peers.peers["d/0"].challenge == b""  # kept as registered, whatever challenge it carried


def test_past_the_bounds_the_least_recently_used_idle_session_is_evicted_and_told() -> None:
    p = Prefill(max_sessions=3, max_sessions_per_endpoint=2)
    for i, now in enumerate((0.0, 1.0)):  # one endpoint, two sessions: its bound
        register_answered(p.book, reg(f"a/{i}", "tcp://a", data="data-a", base=1 << 40), now)
    register_answered(p.book, reg("b/0", "tcp://b", base=1 << 41), 2.0)
    p.book.on_message(m.TransferRequest(7, "a/0", (1, 2), 0, 0), 3.0)  # a/0 used last: a/1 is its LRU
    p.replies()
    register_answered(p.book, reg("a/2", "tcp://a", data="data-a", base=1 << 40), 4.0)
    assert p.replies() == [("a/1", S.EVICTED, "tcp://a"), ("a/2", S.ACCEPTED, "tcp://a")]
    register_answered(p.book, reg("c/0", "tcp://c", base=1 << 42), 5.0)  # the table is full: b/0 is LRU
    assert p.replies() == [("b/0", S.EVICTED, "tcp://b"), ("c/0", S.ACCEPTED, "tcp://c")]
    assert sorted(p.book.peers.peers) == ["a/0", "a/2", "c/0"]
    # a/0's room (the engine admitted it) protects it; with every other session busy too, a
    # newcomer is refused and names why
    p.book.add_room(7, np.arange(2), 5.0)
    for s, room in (("a/2", 8), ("c/0", 9)):
        p.book.add_room(room, np.arange(2), 5.0)
        p.book.on_message(m.TransferRequest(room, s, (3, 4), 0, 0), 5.0)
    register_answered(p.book, reg("d/0", "tcp://d", base=1 << 43), 6.0)
    [(_, state, _)] = p.replies()
    assert state is S.REFUSED and sorted(p.book.peers.peers) == ["a/0", "a/2", "c/0"]


def test_an_eviction_drops_the_sessions_claims_on_rooms_not_admitted_yet() -> None:
    p = Prefill(max_sessions=1)
    register_answered(p.book, reg("a/0", "tcp://a"), 0.0)
    p.book.on_message(m.TransferRequest(7, "a/0", (1, 2), 0, 0), 0.5)  # ahead of the engine: an orphan
    assert 7 in p.book.rooms
    register_answered(p.book, reg("b/0", "tcp://b", base=1 << 41), 1.0)
    assert 7 not in p.book.rooms and len(p.book.orphans) == 0  # no status: its decode asks again
    assert not [msg for _, msg in p.sent if isinstance(msg, m.TransferStatus)]


def test_a_session_without_rooms_is_evicted_after_the_idle_timeout_heartbeats_or_not() -> None:
    p = Prefill(session_idle_s=5)
    register_answered(p.book, reg("a/0", "tcp://a"), 0.0)
    register_answered(p.book, reg("b/0", "tcp://b", base=1 << 41), 0.0)
    p.book.add_room(1, np.arange(2), 0.0)
    p.book.on_message(m.TransferRequest(1, "b/0", (1, 2), 0, 0), 0.0)
    p.replies()
    for now in (2.0, 4.0, 5.5):
        p.book.on_message(m.Heartbeat("a/0", int(now)), now)
        p.book.housekeeping(now)
    assert p.replies() == [("a/0", S.EVICTED, "tcp://a")] and list(p.book.peers.peers) == ["b/0"]


def test_claim_groups_wait_side_by_side_and_admission_keeps_the_rooms_own() -> None:
    p = Prefill()
    register_answered(p.book, reg("rogue/0", "tcp://rogue"), 0.0)
    register_answered(p.book, reg("d/0", "tcp://d", base=1 << 41), 0.0)
    claim = m.room_claim(7, [1, 2, 3])
    p.book.on_message(m.TransferRequest(7, "rogue/0", (1, 2), 0, 0, claim=m.room_claim(7, [9])), 1.0)
    p.book.on_message(m.TransferRequest(7, "d/0", (3, 4), 0, 0, claim=claim), 1.1)
    assert sorted(p.book.rooms[7].dests) == ["d/0", "rogue/0"]
    p.book.on_message(m.Abort(7, "rogue/0", m.Side.DECODE, "never mind"), 1.2)  # drops its claim only
    assert list(p.book.rooms[7].dests) == ["d/0"] and p.book.rooms[7].rec.state is TransferState.BOOTSTRAPPING
    p.book.on_message(m.TransferRequest(7, "rogue/0", (1, 2), 0, 0), 1.3)  # repeated: refused silently
    p.book.add_room(7, np.arange(2), 2.0, claim=claim)
    assert list(p.book.rooms[7].dests) == ["d/0"] and p.book.rooms[7].rec.state is TransferState.WAITING_FOR_INPUT
    p.book.on_message(m.TransferRequest(8, "rogue/0", (1, 2), 0, 0, claim=b"x" * 16), 2.0)
    p.book.on_message(m.TransferRequest(8, "d/0", (3, 4), 0, 0, claim=m.room_claim(8, [5])), 2.0)
    p.book.add_room(8, np.arange(2), 2.5, claim=m.room_claim(8, [5]))
    statuses = {(msg.room, msg.session_id): msg for _, msg in p.sent if isinstance(msg, m.TransferStatus)}
    assert set(statuses) == {(7, "rogue/0"), (8, "rogue/0")}  # the rogue's claims, refused; the victim's kept
    assert "belongs to another request" in statuses[(8, "rogue/0")].reason
    assert list(p.book.rooms[8].dests) == ["d/0"]


def test_without_claims_the_first_decode_keeps_the_room() -> None:
    """Bare senders and receivers (tests, benchmarks) name no claims: the old first-come rule."""
    p = Prefill()
    register_answered(p.book, reg("a/0", "tcp://a"), 0.0)
    register_answered(p.book, reg("b/0", "tcp://b", base=1 << 41), 0.0)
    p.book.on_message(m.TransferRequest(7, "a/0", (1, 2), 0, 0), 1.0)
    p.book.on_message(m.TransferRequest(7, "b/0", (3, 4), 0, 0), 1.0)
    [st] = [msg for _, msg in p.sent if isinstance(msg, m.TransferStatus)]
    assert st.session_id == "b/0" and "duplicate bootstrap_room" in st.reason


class Decode:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        lay = layout(1 << 44)
        self.book = ReceiverBook(CFG, [m.DecodeRank(lay, "data-d0")], "d", "tcp://decode", self._send)
        self.info = PrefillInstanceInfo(
            "p0", 1, "m", (PrefillRankInfo(0, 1, layout(1 << 30), "data-p0", "tcp://p0-0", "m", "p0"),)
        )

    def _send(self, a: str, msg: object) -> bool:
        self.sent.append((a, msg))
        return True

    def take(self, kind: type) -> list:
        out = [msg for _, msg in self.sent if isinstance(msg, kind)]
        self.sent.clear()
        return out

    def add(self, room: int, now: float) -> None:
        pages = self.book.check_pages(room, [np.arange(2) + 2 * room], 0)
        if self.book.add_room(room, ADDR, pages, 0, 0, now) is not None:
            self.book.on_fetched(ADDR, self.info, None, now)

    def reply(self, state: m.RegisterState, now: float, challenge: bytes = b"", session: str | None = None) -> None:
        session = session or self.book.prefills[ADDR].mine[0]
        self.book.on_message(m.RegisterReply(session, "p0/0", state, challenge, "table full"), now)


def test_the_decode_requests_only_once_registered_and_answers_challenges_a_bounded_number_of_times() -> None:
    d = Decode()
    d.add(1, 0.0)
    [first] = d.take(m.RegisterPeer)
    assert d.book.room_state(1) is TransferState.BOOTSTRAPPING and d.take(m.TransferRequest) == []
    for i in range(MAX_CHALLENGES + 2):
        d.reply(S.CHALLENGE, 0.1, challenge=bytes([i]) * 24)
    answers = d.take(m.RegisterPeer)
    assert [a.challenge for a in answers] == [bytes([i]) * 24 for i in range(MAX_CHALLENGES)]
    assert all(dataclasses.replace(a, challenge=b"") == first for a in answers)
    d.reply(S.ACCEPTED, 0.2, session="d/0/not-ours")  # a reply for a session we never had
    assert d.book.stats.foreign_rejected == 1 and d.book.room_state(1) is TransferState.BOOTSTRAPPING
    d.reply(S.ACCEPTED, 0.2)
    [req] = d.take(m.TransferRequest)
    assert req.room == 1 and d.book.room_state(1) is TransferState.WAITING_FOR_INPUT


def test_a_refused_registration_fails_the_waiting_rooms_with_the_prefills_reason() -> None:
    d = Decode()
    d.add(1, 0.0)
    d.add(2, 0.0)
    assert len(d.take(m.RegisterPeer)) == 1  # one registration for both rooms
    d.reply(S.REFUSED, 0.5)
    out = d.book.poll(0.5)  # nothing was requested: the pages are free at once
    assert [(room, state) for room, state, *_ in out] == [(1, TransferState.FAILED), (2, TransferState.FAILED)]
    assert all("refused the registration of decode rank 0: table full" in reason for _, _, reason, _ in out)
    d.add(3, 1.0)  # the next room tries again
    assert [r.session_id for r in d.take(m.RegisterPeer)] == [d.book.prefills[ADDR].mine[0]]


def test_an_evicted_session_registers_again_and_asks_again_for_its_rooms() -> None:
    d = Decode()
    d.add(1, 0.0)
    d.reply(S.ACCEPTED, 0.0)
    d.add(2, 0.1)
    assert [r.room for r in d.take(m.TransferRequest)] == [1, 2]
    d.book.on_message(m.TransferStatus(1, d.book.prefills[ADDR].mine[0], m.WireState.FAILED, "x", sender="p0/0"), 0.2)
    d.reply(S.EVICTED, 0.3)  # room 2 was never answered: its claim was dropped with the session
    [again] = d.take(m.RegisterPeer)
    d.reply(S.CHALLENGE, 0.4, challenge=b"c" * 24)
    d.reply(S.ACCEPTED, 0.5)
    assert [r.room for r in d.take(m.TransferRequest)] == [2] and again.session_id == d.book.prefills[ADDR].mine[0]
    d.add(3, 0.6)  # registered again: requested at once
    assert [r.room for r in d.take(m.TransferRequest)] == [3]


def test_a_registration_no_answer_came_for_is_sent_again_after_a_heartbeat_interval() -> None:
    d = Decode()
    d.add(1, 0.0)
    assert len(d.take(m.RegisterPeer)) == 1
    d.book.housekeeping(0.5)  # within the interval: still waiting for the answer
    assert d.take(m.RegisterPeer) == []
    d.book.housekeeping(CFG.heartbeat_interval_s + 0.1)  # lost? sent again, for the room waiting
    assert len(d.take(m.RegisterPeer)) == 1
    d.reply(S.ACCEPTED, 1.2)
    assert [r.room for r in d.take(m.TransferRequest)] == [1]


def test_a_decode_declared_dead_gets_fresh_connections_at_its_first_word_and_only_then() -> None:
    # After a partition longer than the heartbeat timeout our connections to it sit in TCP's
    # retransmission back-off: the challenge answering its new registration must not queue behind
    # them (docs/faults.md), so the control socket is dropped before that answer goes out, and the
    # backend is asked to reconnect to its data address before the next write (sender/revivals.py).
    events: list[tuple[str, str]] = []
    book = SenderBook(CFG, layout(1 << 30), 0, 1, "p/0", lambda a, msg: events.append(("send", a)) or True)
    book._reconnect = lambda a: events.append(("reconnect", a))
    register_answered(book, reg("a/0", "tcp://a", data="data-a"), 0.0)
    register_answered(book, reg("b/0", "tcp://b", data="data-b", base=1 << 41), 0.0)
    book.on_message(m.Heartbeat("a/0", 1), 1.0)  # alive: nothing to replace
    assert ("reconnect", "tcp://a") not in events and book.take_relinks() == []
    for now in (2.0, 3.0, 4.0, 5.0):  # a is silent past the heartbeat timeout, b is not
        book.on_message(m.Heartbeat("b/0", int(now)), now)
        book.housekeeping(now)
    assert "tcp://a" in book.peers.liveness.dead and "tcp://b" not in book.peers.liveness.dead
    events.clear()
    book.on_message(reg("a/1", "tcp://a", data="data-a"), 20.0)  # it registers again after the heal
    assert events == [("reconnect", "tcp://a"), ("send", "tcp://a")]  # dropped before the challenge went
    assert book.take_relinks() == ["data-a"] and book.take_relinks() == []
    register_answered(book, reg("a/1", "tcp://a", data="data-a"), 20.1)  # the answer: no second drop
    book.on_message(m.Heartbeat("a/1", 1), 20.2)
    assert [e for e in events if e[0] == "reconnect"] == [("reconnect", "tcp://a")] and book.take_relinks() == []
    assert "tcp://a" not in book.peers.liveness.dead
    book.housekeeping(20.2 + CFG.heartbeat_timeout_s + 0.1)  # dead again: its next word reconnects again
    events.clear()
    book.on_message(m.Heartbeat("a/1", 2), 40.0)
    assert events[0] == ("reconnect", "tcp://a") and book.take_relinks() == ["data-a"]


def test_all_dead_needs_known_peers_and_every_one_dead() -> None:
    # KVSender.unreachable (readiness): a prefill that knows no decode yet is ready
    book = SenderBook(CFG, layout(1 << 30), 0, 1, "p/0", lambda a, msg: True)
    live = book.peers.liveness
    assert not live.all_dead()
    register_answered(book, reg("a/0", "tcp://a", data="data-a"), 0.0)
    register_answered(book, reg("b/0", "tcp://b", data="data-b", base=1 << 41), 0.0)
    book.on_message(m.Heartbeat("b/0", 1), 2.0)
    book.housekeeping(4.0)  # a silent past the timeout, b not
    assert live.dead == {"tcp://a"} and not live.all_dead()
    book.housekeeping(5.1)
    assert live.all_dead()
    book.on_message(m.Heartbeat("b/0", 2), 6.0)
    assert not live.all_dead()
