"""ReceiverBook (the decode's KVReceiver without threads, sockets or HTTP): bootstrap outcomes,
final statuses, aborts, deadlines, liveness and prefill restarts, on explicit clock values with
a list as the network."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.bootstrap import (
    DecodeInfo,
    IncompatiblePeerError,
    PrefillInstanceInfo,
    PrefillRankInfo,
    check_compatible,
)
from kvpipe.transfer.control.messages import DecodeRank
from kvpipe.transfer.lifecycle import DuplicateRoomError, TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.tp_mapping import kv_head_range
from kvpipe.transfer.receiver.book import ReceiverBook

L, PS, HD, PAGES, H = 2, 4, 8, 64, 2  # layers, page size, head dim, pages per pool, total KV heads
T = TransferState
CFG = DisaggregationConfig(
    bootstrap_timeout_s=5, waiting_timeout_s=50, heartbeat_interval_s=1, heartbeat_misses=3, transfer_timeout_s=10
)
ADDR = ("prefill-host", 8998)


def layout(tp: int, rank: int) -> KVLayout:
    h0, h1 = kv_head_range(tp, rank, H)
    page = (h1 - h0) * PS * HD * 4
    return KVLayout(
        L, PS, h1 - h0, h0, H, HD, "float32", 4, tuple((rank + 1) << 32 | i << 20 for i in range(2 * L)), PAGES * page
    )


def prefill(instance: str = "p0", tp: int = 1, model: str = "m") -> PrefillInstanceInfo:
    ranks = tuple(
        PrefillRankInfo(p, tp, layout(tp, p), f"data-{instance}-{p}", f"tcp://{instance}-{p}", model, instance)
        for p in range(tp)
    )
    return PrefillInstanceInfo(instance, tp, model, ranks)


class Decode:
    """A ReceiverBook of instance "d" whose network is a list of (address, message)."""

    def __init__(self, tp: int = 1, cfg: DisaggregationConfig = CFG) -> None:
        self.sent: list[tuple[str, object]] = []
        self.full: set[str] = set()  # addresses whose control queue refuses messages
        ranks = [DecodeRank(layout(tp, r), f"data-d{r}") for r in range(tp)]
        self.book = ReceiverBook(cfg, ranks, "d", "tcp://decode", self._send)

    def _send(self, addr: str, msg: object) -> bool:
        self.sent.append((addr, msg))
        return addr not in self.full

    def take(self, kind: type | None = None) -> list[tuple[str, object]]:
        """Messages sent since the last take (of `kind` only, the others are dropped)."""
        out = [(a, msg) for a, msg in self.sent if kind is None or isinstance(msg, kind)]
        self.sent.clear()
        return out

    def add(self, room: int, now: float, pages=None, prefix_len: int = 0, addr=ADDR):
        pages = [np.arange(4) + 4 * room] * self.book.tp_size if pages is None else pages
        return self.book.add_room(room, addr, self.book.check_pages(room, pages, prefix_len), prefix_len, room % 7, now)

    def connected(self, room: int, info: PrefillInstanceInfo, now: float = 0.0) -> None:
        """add_room, then the fetch it asked for succeeds."""
        assert self.add(room, now) == ADDR
        self.fetched(ADDR, info, now)

    def fetched(self, addr, info: PrefillInstanceInfo, now: float) -> list[int]:
        """The fetch of `addr` succeeds and every prefill rank accepts our registrations."""
        failed = self.book.on_fetched(addr, info, None, now)
        self.accept(addr, now)
        return failed

    def accept(self, addr=ADDR, now: float = 0.0) -> None:
        """Every prefill rank of the instance at `addr` accepts our registrations waiting for it."""
        peer = self.book.prefills[addr]
        for p, r in sorted(peer.reg.pending):
            reply = m.RegisterReply(peer.mine[r], f"{peer.info.instance_id}/{p}", m.RegisterState.ACCEPTED)
            self.book.on_message(reply, now)

    def s(self, room: int, rank: int = 0) -> str:
        """Our session of decode rank `rank` that room `room` was requested under (random per prefill instance)."""
        return self.book.rooms[room].sessions[rank]

    def mine(self, rank: int = 0, addr=ADDR) -> str:
        """Our session of decode rank `rank` with the prefill instance known at `addr`."""
        return self.book.prefills[addr].mine[rank]

    def sender(self, room: int, rank: int) -> str:
        """A prefill session paired with `rank` that has not reported the room yet (else the first paired one)."""
        r = self.book.rooms[room]
        pairs = [(snd, pair) for (snd, sess), pair in r.senders.items() if sess == r.sessions[rank]]
        return next((snd for snd, pair in pairs if pair not in r.reported), pairs[0][0])

    def status(
        self,
        room: int,
        rank: int = 0,
        ok: bool = True,
        aux_room: int | None = None,
        now: float = 1.0,
        reason: str = "",
    ) -> None:
        """A final status of the next prefill rank paired with decode rank `rank`, as the prefill sends it."""
        aux = m.AuxData(room if aux_room is None else aux_room, 42, -0.5) if ok else None
        r = self.book.rooms.get(room)
        session, sender = (self.s(room, rank), self.sender(room, rank)) if r and r.sessions else ("d/0", "p0/0")
        state = m.WireState.SUCCESS if ok else m.WireState.FAILED
        self.book.on_message(m.TransferStatus(room, session, state, reason, aux, sender), now)


def test_bootstrap_deadline_names_the_last_fetch_error():
    d = Decode()
    assert d.add(1, 0.0) == ADDR  # the caller starts one fetch of this prefill
    assert d.add(2, 1.0) is None  # ... and no second one while it runs
    d.book.fetch_retrying(ADDR, "connection refused")
    d.book.housekeeping(4.9)
    assert d.book.room_state(1) is T.BOOTSTRAPPING and d.book.poll(4.9) == []
    d.book.housekeeping(5.0)
    [(room, state, reason, aux)] = d.book.poll(5.0)  # nothing was requested: pages are free at once
    assert (room, state, aux) == (1, T.FAILED, None)
    assert "prefill-host:8998 failed: not done within 5s (connection refused)" in reason
    d.fetched(ADDR, prefill(), 5.5)  # late: room 2 is still waiting for it
    assert [msg.room for _, msg in d.take(m.TransferRequest)] == [2]
    assert d.book.stats.bootstrap_fetches == 1 and d.book.stats.rooms_failed == 1


def test_fetch_failure_fails_every_waiting_room_and_the_next_room_fetches_again():
    d = Decode()
    d.add(1, 0.0)
    d.add(2, 0.0)
    d.book.on_fetched(ADDR, None, "HTTP 500: boom", 0.5)
    out = d.book.poll(0.5)
    assert [(room, state) for room, state, *_ in out] == [(1, T.FAILED), (2, T.FAILED)]
    assert all("bootstrap with prefill prefill-host:8998 failed: HTTP 500: boom" in r for _, _, r, _ in out)
    assert d.take() == [] and d.book.num_active_rooms() == 0
    assert d.add(3, 1.0) == ADDR and d.book.stats.bootstrap_fetches == 2


def test_incompatible_prefill_fails_the_room_with_the_reason():
    d = Decode()
    info = prefill(model="other-model")
    with pytest.raises(IncompatiblePeerError) as e:  # what KVReceiver's fetch thread runs
        check_compatible(info, DecodeInfo("m", 1, (layout(1, 0),)))
    d.add(1, 0.0)
    d.add(2, 0.0)
    assert e.value.reason == "model_name"
    assert d.book.on_fetched(ADDR, None, str(e.value), 0.1) == [1, 2]  # what the prefill is told
    [(_, state, reason, _), _] = d.book.poll(0.1)  # at once: nothing was requested, nothing can land
    assert state is T.FAILED and "served model name: prefill 'other-model', decode 'm'" in reason
    assert d.take() == []  # never registered with it


def test_success_registers_once_and_delivers_aux():
    d = Decode()
    d.connected(5, prefill(), 0.0)
    (a1, reg), (a2, req) = d.take()
    assert a1 == a2 == "tcp://p0-0"
    assert reg == m.RegisterPeer(d.mine(), 0, 1, "data-d0", "tcp://decode", layout(1, 0))
    assert d.mine().startswith("d/0/") and len(d.mine()) == len("d/0/") + 32  # 128 random bits
    assert req == m.TransferRequest(5, d.mine(), (20, 21, 22, 23), 0, 5)
    assert d.book.room_state(5) is T.WAITING_FOR_INPUT
    assert d.add(6, 0.5, pages=[9, 10], prefix_len=4) is None  # known prefill: requested at once
    assert d.take() == [("tcp://p0-0", m.TransferRequest(6, d.mine(), (9, 10), 4, 6))]
    d.status(5, now=1.0)
    assert d.book.poll(1.0) == [(5, T.SUCCESS, "", m.AuxData(5, 42, -0.5))]
    assert d.book.poll(1.0) == [] and d.book.room_state(5) is None  # reported once
    assert d.book.stats.rooms_succeeded == 1 and d.book.stats.registrations == 1 and d.take() == []


def test_stale_aux_fails_the_room_without_an_abort():
    d = Decode()
    d.connected(5, prefill())
    d.take()
    d.status(5, aux_room=4)
    [(_, state, reason, aux)] = d.book.poll(1.0)  # its only prefill rank gave its final word
    assert state is T.FAILED and aux is None and "aux data of room 4 arrived for room 5" in reason
    assert d.take() == []


def test_a_prefill_ranks_failure_frees_pages_only_after_every_final_or_the_transfer_timeout():
    d = Decode()  # P=2, D=1: decode rank 0 waits for a final status from both prefill ranks
    d.connected(1, prefill(tp=2))
    d.add(2, 0.0)
    d.take()
    d.book.on_message(m.TransferStatus(1, d.s(1), m.WireState.FAILED, "write failed", sender="p0/0"), 1.0)
    assert d.book.room_state(1) is T.FAILED and d.book.poll(1.0) == []  # prefill rank 1 may still write
    aborts = d.take(m.Abort)
    assert {a for a, _ in aborts} == {"tcp://p0-0", "tcp://p0-1"}
    assert all(
        msg == m.Abort(1, d.s(1), m.Side.DECODE, "prefill failed the transfer: write failed") for _, msg in aborts
    )
    d.status(1, ok=False, now=2.0)  # the other rank's final word
    assert [(room, state) for room, state, *_ in d.book.poll(2.0)] == [(1, T.FAILED)]
    d.book.on_message(m.TransferStatus(2, d.s(2), m.WireState.FAILED, "x", sender="p0/1"), 3.0)
    assert d.book.poll(12.9) == []  # the other rank never answers: wait transfer_timeout_s
    assert [room for room, *_ in d.book.poll(13.0)] == [2]


def test_decode_abort_asks_every_paired_prefill_rank_to_stop():
    d = Decode()
    d.connected(1, prefill(tp=2))
    d.take()
    d.book.abort(1, "client disconnected", 1.0)
    assert sorted(d.take()) == [
        (f"tcp://p0-{p}", m.Abort(1, d.s(1), m.Side.DECODE, "client disconnected")) for p in (0, 1)
    ]
    d.book.abort(1, "again", 1.5)  # once is enough
    assert d.take() == [] and d.book.poll(2.0) == []
    d.status(1, ok=False, now=2.0, reason="aborted")
    d.status(1, ok=False, now=2.0, reason="aborted")
    assert d.book.poll(2.0) == [(1, T.FAILED, "client disconnected", None)]
    d.add(2, 3.0, addr=("elsewhere", 1))  # aborted while bootstrapping: nothing to stop
    d.book.abort(2, "gone", 3.0)
    assert d.take() == [] and d.book.poll(3.0)[0][:2] == (2, T.FAILED)


def test_prefill_abort_waits_for_its_final_status():
    d = Decode()
    d.connected(1, prefill())
    d.take()
    d.book.on_message(m.Abort(1, d.s(1), m.Side.DECODE, "spoofed"), 0.5)
    assert d.book.room_state(1) is T.WAITING_FOR_INPUT and d.book.stats.rejected_messages == 1
    d.book.on_message(m.Abort(1, d.s(1), m.Side.PREFILL, "prefill OOM", "p0/0"), 1.0)
    assert d.book.poll(1.0) == []  # its writes may still be in flight
    d.status(1, ok=False, now=1.5)
    assert d.book.poll(1.5) == [(1, T.FAILED, "aborted by prefill: prefill OOM", None)]


def test_waiting_deadline_fails_and_aborts():
    d = Decode(cfg=dataclasses.replace(CFG, heartbeat_misses=100))  # the prefill stays alive
    d.connected(1, prefill())
    d.take()
    d.book.housekeeping(49.9)
    assert d.book.room_state(1) is T.WAITING_FOR_INPUT
    d.book.housekeeping(50.0)
    assert "waiting_for_input timed out after 50s: not every prefill rank" in d.book.rooms[1].rec.reason
    assert [msg.room for _, msg in d.take(m.Abort)] == [1]
    assert d.book.poll(59.9) == [] and d.book.poll(60.0)[0][0] == 1


def test_full_control_queue_fails_the_request():
    d = Decode()
    d.full = {"tcp://p0-0"}
    d.connected(1, prefill(tp=2))
    assert "control queue to prefill prefill-host:8998 is full" in d.book.rooms[1].rec.reason
    assert [a for a, _ in d.take(m.TransferRequest)] == ["tcp://p0-0", "tcp://p0-1"]  # each was tried
    assert d.book.poll(0.0) == []  # a request might have gone out: wait for the prefill or the timeout


def test_heartbeats_one_per_prefill_rank_with_increasing_seq():
    d = Decode(tp=2)  # P=1, D=2: the prefill rank pairs with both decode ranks, gets one beat
    d.book.heartbeats(0.0)
    assert d.take() == []  # nobody known yet
    d.connected(1, prefill(), 0.0)
    d.take()
    d.book.heartbeats(0.9)  # an interval has not passed since the first round
    d.book.housekeeping(1.5)  # the worker's housekeeping never beats (the pulse thread does)
    assert d.take() == []
    for now in (1.0, 1.5, 2.0):
        d.book.heartbeats(now)
    assert d.take() == [("tcp://p0-0", m.Heartbeat(d.mine(1), 1)), ("tcp://p0-0", m.Heartbeat(d.mine(1), 2))]


def test_heartbeat_death_keeps_pages_until_quiet_and_forgets_the_prefill():
    d = Decode()
    d.connected(1, prefill(), 0.0)
    d.take()
    d.book.on_message(m.Heartbeat("p0/0", 7), 2.0)
    d.book.housekeeping(5.0)
    assert d.book.room_state(1) is T.WAITING_FOR_INPUT  # silent for exactly 3 misses * 1 s: alive
    d.book.housekeeping(5.01)
    assert (
        d.book.room_state(1) is T.FAILED
        and "prefill rank 0 at prefill-host:8998 sent no heartbeat for 3.0s" in d.book.rooms[1].rec.reason
    )
    assert [msg.room for _, msg in d.take(m.Abort)] == [1]
    # has_news (what wakes the decode's engine loop, which no longer polls every 2 ms) says
    # exactly when poll() has a room: not while writes may still land, then at the quiet deadline
    assert not d.book.has_news(15.0) and d.book.poll(15.0) == []  # a silent prefill may have writes in flight
    assert d.book.has_news(15.01)
    assert d.book.poll(15.01)[0][:2] == (1, T.FAILED)
    assert not d.book.has_news(15.02)  # reported once
    assert d.add(2, 16.0) == ADDR  # forgotten: the next room fetches its bootstrap info again


def test_a_prefill_is_judged_by_heartbeats_only_once_it_answered_the_registration():
    """After a healed partition the registration's answer may come seconds late (TCP resends at
    its backed-off RTO): until it comes the bootstrap deadline (5 s) judges the prefill, not the
    heartbeat timeout (3 s), which would drop it with the answer on the way (issue 50)."""
    d = Decode()
    assert d.add(1, 0.0) == ADDR
    d.book.on_fetched(ADDR, prefill(), None, 0.0)  # RegisterPeer sent, no answer yet
    d.book.housekeeping(4.0)
    assert d.book.room_state(1) is T.BOOTSTRAPPING and ADDR in d.book.prefills
    d.accept(ADDR, 4.5)  # the answer arrives; from now on heartbeats are due
    assert d.book.room_state(1) is T.WAITING_FOR_INPUT
    d.book.housekeeping(7.4)
    assert d.book.room_state(1) is T.WAITING_FOR_INPUT
    d.book.housekeeping(7.6)  # 3.1 s silent since its answer
    assert d.book.room_state(1) is T.FAILED and "sent no heartbeat" in d.book.rooms[1].rec.reason


def test_prefill_restart_fails_old_rooms_and_frees_them_at_once():
    d = Decode()
    d.connected(1, prefill("p0"), 0.0)
    d.book.housekeeping(3.5)  # p0 dies: room 1 fails, keeps its pages
    assert d.book.room_state(1) is T.FAILED and d.book.poll(3.5) == []
    d.take()
    assert d.add(2, 4.0) == ADDR
    d.fetched(ADDR, prefill("p1"), 4.0)  # a new instance there: p0's writes cannot land
    [(room, state, reason, _)] = d.book.poll(4.0)
    assert (room, state) == (1, T.FAILED) and "sent no heartbeat" in reason
    assert [type(msg).__name__ for _, msg in d.take()] == ["RegisterPeer", "TransferRequest"]
    assert d.book.stats.registrations == 2 and d.book.room_state(2) is T.WAITING_FOR_INPUT
    # A fetch that finds another instance while the old one is still known drops it the same way.
    d.fetched(ADDR, prefill("p2"), 5.0)
    [(room, state, reason, _)] = d.book.poll(5.0)
    assert (room, state) == (2, T.FAILED) and "restarted (instance p1 -> p2)" in reason
    assert not any(isinstance(msg, m.Abort) for _, msg in d.take())  # p1 is gone: nobody to tell
    d.book.on_message(m.TransferStatus(2, "d/0", m.WireState.FAILED, "x", sender="p1/0"), 5.5)  # not a room any more
    assert d.book.stats.rejected_messages == 1


def test_duplicate_room_is_refused_and_the_first_unharmed():
    d = Decode()
    d.connected(1, prefill())
    d.take()
    with pytest.raises(DuplicateRoomError):
        d.add(1, 0.5)
    assert d.take() == [] and d.book.num_active_rooms() == 1
    d.status(1)
    assert d.book.poll(1.0)[0][:2] == (1, T.SUCCESS)
    assert d.add(1, 2.0) is None  # reported: the id may be used again


def test_two_prefill_ranks_into_one_decode_rank():
    d = Decode()  # P=2, D=1
    d.connected(1, prefill(tp=2))
    sent = d.take()
    assert [(a, type(msg).__name__) for a, msg in sent] == [
        ("tcp://p0-0", "RegisterPeer"),
        ("tcp://p0-1", "RegisterPeer"),
        ("tcp://p0-0", "TransferRequest"),
        ("tcp://p0-1", "TransferRequest"),
    ]
    d.status(1)
    assert d.book.room_state(1) is T.TRANSFERRING and d.book.poll(1.0) == []
    d.status(1)
    assert d.book.poll(1.0)[0][:2] == (1, T.SUCCESS)


def test_one_prefill_rank_into_two_decode_ranks():
    d = Decode(tp=2)  # P=1, D=2: each decode rank gets its own pages and its own final status
    d.add(1, 0.0, pages=[np.array([1, 2]), np.array([3, 4])])
    d.fetched(ADDR, prefill(), 0.0)
    regs, reqs = d.take(m.RegisterPeer), None
    assert [(a, msg.session_id, msg.tp_rank, msg.data_address) for a, msg in regs] == [
        ("tcp://p0-0", d.mine(0), 0, "data-d0"),
        ("tcp://p0-0", d.mine(1), 1, "data-d1"),
    ]
    d.book.abort(9, "unknown room", 0.0)  # nothing happens
    d.add(2, 0.5, pages=[np.array([5]), np.array([6])])
    reqs = d.take(m.TransferRequest)
    assert [(msg.session_id, msg.dst_pages) for _, msg in reqs] == [(d.mine(0), (5,)), (d.mine(1), (6,))]
    d.status(1, rank=0)
    d.status(1, rank=0)  # one final per (room, session, prefill rank): a second one is refused
    assert d.book.stats.rejected_messages == 1 and d.book.poll(1.0) == []
    d.status(1, rank=1)
    assert d.book.poll(1.0)[0][:2] == (1, T.SUCCESS)


def test_page_checks():
    d = Decode(tp=2)
    with pytest.raises(ValueError, match="1 page lists for 2 decode ranks"):
        d.book.check_pages(1, [1, 2], 0)
    with pytest.raises(ValueError, match="not a multiple of the page size 4"):
        d.book.check_pages(1, [[1], [2]], 2)
    with pytest.raises(ValueError, match=r"decode rank 1 pages must be distinct ids in \[0, 64\)"):
        d.book.check_pages(1, [[1], [2, 2]], 0)
    with pytest.raises(ValueError, match="decode rank 0 pages"):
        d.book.check_pages(1, [[PAGES], [2]], 0)
    pages = d.book.check_pages(1, [np.array([3]), [4, 5]], 8)
    assert [p.tolist() for p in pages] == [[3], [4, 5]] and all(p.dtype == np.int64 for p in pages)


def test_messages_that_are_not_for_a_waiting_room_are_rejected():
    d = Decode()
    d.add(1, 0.0)  # still bootstrapping: nothing requested, nothing may answer
    d.status(1)
    d.status(2)
    d.book.on_message(m.TransferStatus(1, "stranger/0", m.WireState.FAILED), 0.0)
    d.book.on_message(m.TransferRequest(1, "d/0/x", (1,), 0, 0), 0.0)
    d.book.on_message(m.Heartbeat("stranger/0", 1), 0.0)  # ignored, not counted
    assert d.book.stats.rejected_messages == 4 and d.book.room_state(1) is T.BOOTSTRAPPING


def test_a_fetch_requests_only_the_rooms_that_still_wait_for_it():
    d = Decode()
    d.add(5, 0.0)
    d.book.abort(5, "client gone", 0.1)
    assert d.book.poll(0.1)[0][:2] == (5, T.FAILED)
    assert d.add(5, 0.2, addr=("other", 1)) == ("other", 1)  # the id comes back for another prefill
    d.add(6, 0.3)
    d.book.abort(6, "client gone", 0.3)
    d.book.poll(0.3)
    assert d.add(6, 0.4) is None  # back for the same prefill, whose fetch still runs
    d.fetched(ADDR, prefill(), 0.5)
    assert [msg.room for _, msg in d.take(m.TransferRequest)] == [6]  # once; room 5 waits for "other"
    assert d.book.room_state(5) is T.BOOTSTRAPPING


def test_a_request_that_never_asked_is_aborted_on_every_paired_prefill_rank():
    d = Decode()
    assert not d.book.abort_unrequested(9, ADDR, "gone")  # prefill unknown: nothing to tell
    d.connected(1, prefill(tp=2))
    d.take()
    assert d.book.abort_unrequested(9, ADDR, "waited too long for pages")
    assert sorted(d.take()) == [
        (f"tcp://p0-{p}", m.Abort(9, d.mine(), m.Side.DECODE, "waited too long for pages")) for p in (0, 1)
    ]
    assert not d.book.abort_unrequested(1, ADDR, "has a room: abort() is for it") and d.take() == []


def test_forged_statuses_for_another_sessions_room_are_refused_and_counted():
    """Issue 30, finding 5: whoever holds the token but never saw the room's request cannot finish
    (or fail) it: the room keeps waiting, so the decode never decodes pages nobody wrote, until
    the prefill it asked answers."""
    d = Decode()
    d.connected(1, prefill("p0"))
    other = ("evil-host", 8998)  # a second prefill this decode also uses (a legit registration)
    assert d.add(2, 0.0, addr=other) == other
    d.fetched(other, prefill("evil"), 0.0)
    d.take()
    assert d.mine(0) != d.mine(0, other)  # one random session per prefill instance
    ok, aux = m.WireState.SUCCESS, m.AuxData(1, 13, -0.1)
    forged = [
        m.TransferStatus(1, "d/0", ok, "", aux, "p0/0"),  # the session's guessable prefix, the real sender's name
        m.TransferStatus(1, d.mine(0, other), ok, "", aux, "evil/0"),  # evil's own session with us
        m.TransferStatus(1, d.mine(0, other), ok, "", aux, "p0/0"),  # ... claiming p0's (public) name
        m.TransferStatus(1, d.s(1), ok, "", aux, "evil/0"),  # the right session, another instance's rank
        m.TransferStatus(1, d.s(1), ok, "", aux, "p0/1"),  # a rank p0 does not have
        m.TransferStatus(1, d.s(1), ok, "", aux, ""),  # no sender at all
        m.Abort(1, d.mine(0, other), m.Side.PREFILL, "forged", "evil/0"),
    ]
    for msg in forged:
        d.book.on_message(msg, 0.5)
    assert d.book.room_state(1) is T.WAITING_FOR_INPUT and d.book.poll(0.5) == []
    assert d.book.stats.foreign_rejected == len(forged) == d.book.stats.rejected_messages
    d.status(1)  # p0's own final status
    d.status(2)  # and evil's for the room it was asked for
    assert sorted(d.book.poll(1.0)) == [
        (1, T.SUCCESS, "", m.AuxData(1, 42, -0.5)),
        (2, T.SUCCESS, "", m.AuxData(2, 42, -0.5)),
    ]
    assert d.book.num_active_rooms() == 0 and d.book.stats.foreign_rejected == len(forged)


def test_a_room_that_fails_waiting_for_the_registration_is_aborted_once_it_is_accepted():
    # The prefill holds a request until its bootstrap timeout unless told; a prefill rank takes an
    # Abort only from a session it registered, so the abort waits for the registration.
    d = Decode()
    assert d.add(1, 0.0) == ADDR
    d.book.on_fetched(ADDR, prefill(tp=2), None, 0.1)
    d.take()
    d.book.abort(1, "client gone", 0.2)
    assert d.book.poll(0.2)[0][:2] == (1, T.FAILED)  # nothing requested: its pages are free at once
    assert d.take(m.Abort) == []  # not yet registered: the prefill would refuse it
    d.accept(ADDR, 0.3)
    assert sorted(d.take()) == [(f"tcp://p0-{p}", m.Abort(1, d.mine(), m.Side.DECODE, "client gone")) for p in (0, 1)]
    d.book.housekeeping(9.0)  # told once, and the registration is not sent again for it
    assert d.take() == []


def test_a_room_that_fails_waiting_for_the_fetch_is_aborted_once_registered():
    d = Decode()
    assert d.add(1, 0.0) == ADDR
    d.book.housekeeping(5.0)  # the bootstrap deadline passes before the fetch answers
    assert d.book.poll(5.0)[0][:2] == (1, T.FAILED)
    d.book.on_fetched(ADDR, prefill(), None, 5.5)  # late: still registered with, for the abort
    assert d.take(m.TransferRequest) == []
    d.book.housekeeping(6.6)  # an unanswered registration is sent again while an abort waits
    assert [msg for _, msg in d.take(m.RegisterPeer)]
    d.accept(ADDR, 6.7)
    [(addr, abort)] = d.take(m.Abort)
    assert addr == "tcp://p0-0" and abort.room == 1 and "not done within 5s" in abort.reason


def test_no_abort_for_an_unrequested_room_after_a_refusal_or_when_its_id_is_live_again():
    d = Decode()
    d.add(1, 0.0)
    d.book.on_fetched(ADDR, prefill(), None, 0.1)
    d.book.abort(1, "client gone", 0.2)
    peer = d.book.prefills[ADDR]
    d.book.on_message(m.RegisterReply(d.mine(), "p0/0", m.RegisterState.REFUSED, "no"), 0.3)
    assert d.take(m.Abort) == [] and peer.reg.aborts == []
    d2 = Decode()
    d2.add(2, 0.0)
    d2.book.abort(2, "client gone", 0.1)
    d2.book.poll(0.1)
    assert d2.add(2, 0.2) is None  # the id is back, for the same prefill: its fetch still runs
    d2.fetched(ADDR, prefill(), 0.3)
    sent = [msg for _, msg in d2.take()]
    assert not any(isinstance(msg, m.Abort) for msg in sent)  # it would fail the live room on the prefill
    assert [msg.room for msg in sent if isinstance(msg, m.TransferRequest)] == [2]


def test_a_prefill_dropped_for_silence_gets_a_fresh_connection_when_known_again():
    # After a partition our connection to its ranks may sit in TCP's retransmission back-off: the
    # registration after the heal must not queue behind it (it arrived 12 s late, docs/faults.md).
    dropped: list[str] = []
    d = Decode(tp=1)
    d.book._reconnect = dropped.append
    d.connected(1, prefill(tp=2))
    d.book.housekeeping(0.5 + CFG.bootstrap_timeout_s)  # no heartbeat at all: dropped for silence
    assert ADDR not in d.book.prefills and dropped == []  # its aborts may still flush meanwhile
    assert d.add(2, 20.0) == ADDR
    d.book.on_fetched(ADDR, prefill(tp=2), None, 20.1)
    assert sorted(dropped) == ["tcp://p0-0", "tcp://p0-1"]  # before the registration is sent again
    d2 = Decode()
    d2.book._reconnect = dropped.append
    d2.connected(1, prefill())
    d2.book.on_fetched(ADDR, prefill("p1"), None, 1.0)  # restarted, not silent: nothing to replace
    assert sorted(dropped) == ["tcp://p0-0", "tcp://p0-1"]


def test_a_prefill_dropped_for_silence_is_looked_for_until_found_and_readiness_follows() -> None:
    # receiver/lost.py: no request is needed to find it again after a heal, and until then the decode
    # says why it cannot serve; a decode that never knew a prefill is ready (no flapping at start)
    d = Decode()
    assert d.book.unreachable(0.0) is None and d.book.take_refetches(0.0) == []
    d.connected(1, prefill())
    d.book.on_message(m.Heartbeat("p0/0", 0), 0.5)
    assert d.book.unreachable(1.0) is None
    dropped_at = 0.5 + CFG.heartbeat_timeout_s + 0.1
    d.book.housekeeping(dropped_at)
    assert ADDR not in d.book.prefills
    why = d.book.unreachable(dropped_at)
    assert why is not None and why.startswith("no reachable prefill: 1 prefill(s) dropped for missed heartbeats")
    assert "prefill-host" not in why  # an open route answers with it: no addresses
    assert d.book.take_refetches(dropped_at) == []  # the link just failed: not at once
    retry = dropped_at + d.book.lost.retry_s
    assert d.book.take_refetches(retry) == [ADDR]
    assert d.book.take_refetches(retry + 5 * d.book.lost.retry_s) == []  # that look has not ended yet
    assert d.book.on_fetched(ADDR, None, "unreachable", retry + 1.0) == []  # still partitioned
    assert d.book.unreachable(retry + 1.0) is not None
    later = retry + 2 * d.book.lost.retry_s
    assert d.book.take_refetches(later) == [ADDR]
    d.take()
    assert d.book.on_fetched(ADDR, prefill(), None, later) == []  # it answers: installed, registering
    assert ADDR in d.book.prefills and d.book.unreachable(later) is None
    assert [a for a, _ in d.take(m.RegisterPeer)] == ["tcp://p0-0"]  # at once, with no request waiting
    assert d.book.take_refetches(later + 60.0) == []  # found: no more looks


def test_a_prefill_looked_for_in_vain_is_forgotten_and_readiness_comes_back() -> None:
    # a removed prefill (its successor has a new address) must not keep a decode unready for good
    d = Decode()
    d.connected(1, prefill())
    d.book.housekeeping(CFG.heartbeat_timeout_s + 0.1)
    assert d.book.unreachable(CFG.heartbeat_timeout_s + 0.1) is not None
    end = CFG.heartbeat_timeout_s + 0.2 + d.book.lost.forget_s
    assert d.book.take_refetches(end) == [] and d.book.unreachable(end) is None
