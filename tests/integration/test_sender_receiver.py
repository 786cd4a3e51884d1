"""KVSender <-> KVReceiver in one process (tests/helpers/kv_transfer.py): real KV pools, real
bootstrap server, real ZMQ, local and Mooncake (loopback TCP) backends. Every wait is bounded;
heartbeats are fast."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from kvpipe.config import FaultInjection
from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.bootstrap import BootstrapServer, PrefillRankInfo, register_prefill_rank
from kvpipe.transfer.lifecycle import DuplicateRoomError, TransferState
from kvpipe.transfer.receiver.kv_receiver import KVReceiver
from kvpipe.transfer.staging.buffers import KVBytes
from tests.helpers.kv_transfer import (
    CFG,
    LATENT_DIM,
    PAGES,
    PS,
    SRC,
    H,
    L,
    Prefill,
    Results,
    assert_moved,
    rank_pool,
    start_decode,
    start_prefill,
    wait_for,
)

S, F = TransferState.SUCCESS, TransferState.FAILED


@pytest.mark.parametrize("kind", ["local", "mooncake"])
def test_chunked_transfer_with_decode_prefix(stack, kind):
    fabric = LocalFabric()
    prefill = start_prefill(stack, kind, fabric)
    recv = start_decode(stack, kind, fabric)
    sender = prefill.senders[0]
    dst = np.array([20, 21, 7, 8])  # decode holds 8 tokens (2 pages) already: pages for tokens 8..21
    recv.add_room(11, "127.0.0.1", prefill.port, dst, prefix_len=8)
    sender.add_room(11, SRC[:2])  # pages are allocated chunk by chunk
    assert sender.send(11, 0, 6)  # entirely inside decode's prefix: nothing to write
    assert sender.send(11, 6, 13, src_pages=SRC[:4])  # page 2 (tokens 8..11) is full; page 3 waits
    with pytest.raises(ValueError, match="must extend"):
        sender.send(11, 13, 22, src_pages=SRC[::-1])
    assert sender.send(11, 13, 22, last=True, aux=(42, -0.25), src_pages=SRC)  # pages 3..5, the last partial
    assert Results(sender).get(11) == (11, S, "")
    room, state, reason, aux = Results(recv).get(11)
    assert (state, reason) == (S, "") and aux == m.AuxData(11, 42, -0.25)
    assert_moved(prefill, recv, SRC[2:], dst, np.setdiff1d(np.arange(PAGES), dst))
    assert sender.stats.rooms_succeeded == 1 and recv.stats.rooms_succeeded == 1
    assert sender.num_active_rooms() == 0 and recv.num_active_rooms() == 0


@pytest.mark.parametrize("kind", ["local", "mooncake"])
def test_pump_and_on_news(stack, kind):
    """pump() submits on the caller's thread (or leaves it to a worker pass under way); on_news
    fires once the room is ready for poll(), so an engine need not wait for its poll timer."""
    fabric = LocalFabric()
    news = threading.Event()
    prefill = start_prefill(stack, kind, fabric, on_news=news.set)
    recv = start_decode(stack, kind, fabric)
    sender = prefill.senders[0]
    dst = np.array([1, 2, 3, 4, 5, 6])
    recv.add_room(13, "127.0.0.1", prefill.port, dst)
    sender.add_room(13, SRC)
    sender.pump()  # nothing to send yet
    assert not news.is_set()
    assert sender.send(13, 0, 22, last=True, aux=(7, -1.0))
    sender.pump()
    assert news.wait(10.0), "on_news was not called"
    assert Results(sender).get(13) == (13, S, "")
    assert Results(recv).get(13)[1] is S
    assert_moved(prefill, recv, SRC, dst, np.setdiff1d(np.arange(PAGES), dst))


def test_layer_groups_and_sends_before_the_request(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric)
    recv = start_decode(stack, fabric=fabric)
    sender = prefill.senders[0]
    sender.add_room(5, SRC)
    # Layer-pipelined prefill of one 22-token chunk, before the decode asked for anything: queued.
    sender.send(5, 0, 22, 0, 1)
    sender.send(5, 0, 22, 1, 2, last=True, aux=(7, -1.0))
    assert sender.room_state(5) is TransferState.BOOTSTRAPPING
    dst = np.array([30, 2, 17, 18, 19, 0])
    recv.add_room(5, "127.0.0.1", prefill.port, dst, prefix_len=0)
    assert Results(recv).get(5)[1:] == (S, "", m.AuxData(5, 7, -1.0))
    assert Results(sender).get(5)[1] is S
    assert_moved(prefill, recv, SRC, dst, np.setdiff1d(np.arange(PAGES), dst))


def move_behind_one_page_prefix(prefill: Prefill, recv: KVReceiver, d_tp: int) -> np.ndarray:
    """Room 9: SRC's pages past a one-page decode prefix, sent in two chunks by every prefill
    rank into decode pages [1, 2, 3, 12, 13]; both sides succeed and every rank's share landed.
    Returns the decode pages."""
    dst = np.array([1, 2, 3, 12, 13])
    recv.add_room(9, "127.0.0.1", prefill.port, [dst] * d_tp, prefix_len=4)
    for s in prefill.senders:
        s.add_room(9, SRC)
        s.send(9, 0, 10)
        s.send(9, 10, 21, last=True, aux=(3, -0.5))
    for s in prefill.senders:
        assert Results(s).get(9)[1:] == (S, "")
    assert Results(recv).get(9)[1] is S
    assert_moved(prefill, recv, SRC[1:], dst, np.setdiff1d(np.arange(PAGES), dst))
    return dst


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4)])
def test_heterogeneous_tp(stack, p_tp, d_tp):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, tp=p_tp)
    recv = start_decode(stack, fabric=fabric, tp=d_tp)
    move_behind_one_page_prefix(prefill, recv, d_tp)
    if p_tp > H:  # replicated heads: only one prefill rank per head writes
        assert sum(s.stats.ops_submitted > 0 for s in prefill.senders) == H


@pytest.mark.parametrize("kind", ["local", "mooncake"])
@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2)])
def test_mla_latent_heterogeneous_tp_writes_each_decode_rank_once(stack, kind, p_tp, d_tp):
    """An MLA latent is replicated on every rank: each decode rank reads it whole from exactly one
    prefill rank (no slicing, no duplicate writes), one op per layer and page run, and the bytes
    on the wire are exactly the prediction."""
    fabric = LocalFabric()
    prefill = start_prefill(stack, kind, fabric, tp=p_tp, latent=True)
    recv = start_decode(stack, kind, fabric, tp=d_tp, latent=True)
    dst = move_behind_one_page_prefix(prefill, recv, d_tp)
    per_rank_bytes = L * dst.size * PS * LATENT_DIM * 4  # every layer's latent of the pages past the prefix
    stats = [s.stats for s in prefill.senders]
    assert sum(st.bytes_written for st in stats) == d_tp * per_rank_bytes  # each decode rank written once
    # first send: page 4 -> 1 (page 5 still filling); last: 5 -> 2, 9 -> 3, [10, 11] -> [12, 13]
    runs = 4
    assert sum(st.ops_submitted for st in stats) == d_tp * L * runs  # one op per (layer, run): no K/V pair
    # the sources: decode rank r reads prefill rank r // (d/p) (d >= p) or the first of its group
    writers = [rank for rank, st in enumerate(stats) if st.bytes_written]
    expect = sorted({r // (d_tp // p_tp) if d_tp >= p_tp else r * (p_tp // d_tp) for r in range(d_tp)})
    assert writers == expect


def test_latent_and_kv_layouts_refuse_each_other():
    kv_pool, kv = rank_pool(1, 0, None)
    lat_pool, lat = rank_pool(1, 0, None, latent=True)
    assert lat.latent and lat.num_buffers == L and not kv.latent
    assert "KV kind" in kv.compatible_with(lat)
    with pytest.raises(ValueError, match="one replicated head"):
        dataclasses.replace(lat, total_kv_heads=2)
    with pytest.raises(ValueError, match="latent"):
        KVBytes.from_pool(lat_pool)  # staging never handles a latent pool


def test_decode_abort_keeps_pages_until_prefill_acknowledges(stack):
    """The test plays the prefill rank with raw ZMQ sockets; the decode runs on a fake clock."""
    cfg = dataclasses.replace(CFG, heartbeat_interval_s=1.0, heartbeat_misses=100, transfer_timeout_s=2.0)
    now = [100.0]
    server = stack.enter_context(BootstrapServer("127.0.0.1", 0))
    ctx = zmq.Context()
    stack.callback(ctx.term)
    pull = ctx.socket(zmq.PULL)
    stack.callback(pull.close, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    _, layout = rank_pool(1, 0, None)
    register_prefill_rank(
        "127.0.0.1", server.port, PrefillRankInfo(0, 1, layout, "local:nowhere", f"tcp://127.0.0.1:{port}", "m", "fake")
    )
    recv = start_decode(stack, cfg=cfg, clock=lambda: now[0])
    got = []

    def receive(n):
        while len(got) < n and pull.poll(5000):
            got.append(m.decode(pull.recv()))
        return got

    recv.add_room(1, "127.0.0.1", server.port, [4, 5], prefix_len=0)
    recv.add_room(2, "127.0.0.1", server.port, [6, 7], prefix_len=0)
    [reg] = receive(1)
    assert isinstance(reg, m.RegisterPeer)
    session = reg.session_id  # the decode's session with instance "fake"; we answer as its rank 0
    push = ctx.socket(zmq.PUSH)
    stack.callback(push.close, 0)
    push.connect(recv.control_address)
    push.send(m.encode(m.RegisterReply(session, "fake/0", m.RegisterState.ACCEPTED)))  # no challenge: accepted
    kinds = [type(x).__name__ for x in receive(3)]
    assert kinds == ["RegisterPeer", "TransferRequest", "TransferRequest"]
    recv.abort(1, "client disconnected")
    recv.abort(2, "client disconnected")
    aborts = [x for x in receive(5)[3:] if isinstance(x, m.Abort)]
    assert {a.room for a in aborts} == {1, 2} and all(a.side is m.Side.DECODE for a in aborts)
    res = Results(recv)
    time.sleep(0.05)
    assert res.absent(1) and res.absent(2)  # a write may still land: pages stay reserved
    push.send(m.encode(m.TransferStatus(1, session, m.WireState.FAILED, "aborted", sender="fake/0")))
    assert res.get(1, timeout=5)[1:3] == (F, "client disconnected")
    assert res.absent(2)
    now[0] += 2.01  # no acknowledgement for room 2: released when the transfer deadline passed
    assert res.get(2, timeout=5)[1] is F
    push.send(m.encode(m.TransferStatus(2, session, m.WireState.FAILED, "late", sender="fake/0")))
    wait_for(lambda: recv.stats.rejected_messages >= 1, 5, "late status rejected")


def test_decode_abort_with_real_prefill(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric)
    recv = start_decode(stack, fabric=fabric)
    sender = prefill.senders[0]
    sender.add_room(3, SRC)
    recv.add_room(3, "127.0.0.1", prefill.port, np.arange(6), prefix_len=0)
    wait_for(lambda: sender.room_state(3) is TransferState.WAITING_FOR_INPUT, 5, "request bound")
    sender.send(3, 0, 8)
    recv.abort(3, "client went away")
    room, state, reason = Results(sender).get(3)
    assert state is F and "aborted by decode: client went away" in reason
    assert Results(recv).get(3)[1:3] == (F, "client went away")
    # A late add_room of the same room on the prefill fails at once instead of waiting.
    sender.add_room(3, SRC)
    assert "already used or aborted" in Results(sender).get(3, timeout=5)[2]
    assert sender.stats.rejected_messages == 0 and recv.stats.rejected_messages == 0


def test_prefill_abort_reaches_decode(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric)
    recv = start_decode(stack, fabric=fabric)
    sender = prefill.senders[0]
    for room in (1, 2):
        sender.add_room(room, SRC)
        recv.add_room(room, "127.0.0.1", prefill.port, np.arange(6) + 6 * room, prefix_len=0)
    wait_for(lambda: sender.room_state(1) is TransferState.WAITING_FOR_INPUT, 5, "request bound")
    sender.send(1, 0, 12)
    sender.abort(1, "prefill OOM")
    assert not sender.send(1, 12, 22, last=True, aux=(1, 0.0))  # the room already failed
    sender.abort(2, "prefill OOM")  # possibly before the decode's request arrived
    rs, rr = Results(sender), Results(recv)
    for room in (1, 2):
        assert rs.get(room)[1] is F
        state, reason = rr.get(room)[1:3]
        assert state is F and "prefill OOM" in reason


def test_malformed_and_invalid_messages_are_dropped(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric)
    recv = start_decode(stack, fabric=fabric)
    sender = prefill.senders[0]
    ctx = zmq.Context()
    stack.callback(ctx.term)
    push = ctx.socket(zmq.PUSH)
    stack.callback(push.close, 0)
    push.connect(sender.control_address)
    push.connect(recv.control_address)  # PUSH round-robins: frames alternate between the two
    bad = [
        b"\x00garbage",
        m.encode(m.Heartbeat("x", 1))[:-1],
        b"\x81\xa4kind\xa5abort",
        m.encode(m.TransferRequest(99, "unregistered", (1, 2), 0, 0)),
        m.encode(m.TransferStatus(99, "nobody", m.WireState.FAILED, "x")),
    ]
    for frame in bad * 2:
        push.send(frame)
    wait_for(lambda: sender._endpoint.stats.received + recv._endpoint.stats.received >= 10, 5, "frames")
    # each frame reaches each endpoint once: 3 garbage frames x 2, plus the TransferRequest at the
    # decode, whose limits (the messages a decode receives) have no room for its fields and pages
    assert sender._endpoint.stats.malformed + recv._endpoint.stats.malformed == 7
    assert sender.stats.rejected_messages + recv.stats.rejected_messages == 3
    sender.add_room(4, SRC)
    recv.add_room(4, "127.0.0.1", prefill.port, np.arange(6), prefix_len=0)
    sender.send(4, 0, 22, last=True, aux=(5, -0.1))
    assert Results(recv).get(4)[1] is S and Results(sender).get(4)[1] is S


def test_decode_death_fails_prefill_rooms(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric)
    recv = start_decode(stack, fabric=fabric)
    sender = prefill.senders[0]
    sender.add_room(8, SRC)
    recv.add_room(8, "127.0.0.1", prefill.port, np.arange(6), prefix_len=0)
    wait_for(lambda: sender.room_state(8) is TransferState.WAITING_FOR_INPUT, 5, "request bound")
    recv.close()  # the decode process is gone: no more heartbeats
    t0 = time.monotonic()
    room, state, reason = Results(sender).get(8, timeout=5)
    assert state is F and "heartbeats missed" in reason
    assert time.monotonic() - t0 < 5 * CFG.heartbeat_timeout_s + 1.0


def test_prefill_death_then_restart_is_picked_up(stack):
    fabric = LocalFabric()
    server = stack.enter_context(BootstrapServer("127.0.0.1", 0))
    first = start_prefill(stack, fabric=fabric, server=server, instance="first")
    recv = start_decode(stack, fabric=fabric, cfg=dataclasses.replace(CFG, transfer_timeout_s=60.0))
    rr = Results(recv)
    recv.add_room(1, "127.0.0.1", server.port, np.arange(6), prefix_len=0)
    wait_for(lambda: first.senders[0].room_state(1) is TransferState.BOOTSTRAPPING, 5, "request arrived")
    first.senders[0].close()  # prefill crashed before admitting the request
    wait_for(lambda: recv.room_state(1) is F, 5, "heartbeat death")
    assert rr.absent(1)  # a silent prefill may only be stalled: pages stay reserved (60 s here)
    registrations = recv.stats.registrations
    second = start_prefill(stack, fabric=fabric, server=server, instance="second", seed=1)
    recv.add_room(2, "127.0.0.1", server.port, np.arange(6) + 10, prefix_len=0)
    state, reason = rr.get(1, timeout=5)[1:3]  # the new instance proves the old one gone
    assert state is F and "sent no heartbeat" in reason and "prefill rank 0" in reason
    second.senders[0].add_room(2, SRC)
    second.senders[0].send(2, 0, 22, last=True, aux=(9, -2.0))
    assert rr.get(2)[1:] == (S, "", m.AuxData(2, 9, -2.0))
    assert recv.stats.registrations == registrations + 1  # registered again with the new instance
    assert_moved(second, recv, SRC, np.arange(6) + 10, np.arange(6))


def test_duplicate_rooms(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric)
    a, b = start_decode(stack, fabric=fabric), start_decode(stack, fabric=fabric)
    sender = prefill.senders[0]
    sender.add_room(6, SRC)
    with pytest.raises(DuplicateRoomError):
        sender.add_room(6, SRC)
    a.add_room(6, "127.0.0.1", prefill.port, np.arange(6), prefix_len=0)
    with pytest.raises(DuplicateRoomError):
        a.add_room(6, "127.0.0.1", prefill.port, np.arange(6), prefix_len=0)
    wait_for(lambda: sender.room_state(6) is TransferState.WAITING_FOR_INPUT, 5, "request bound")
    b.add_room(6, "127.0.0.1", prefill.port, np.arange(6), prefix_len=0)  # a client reused the room
    state, reason = Results(b).get(6)[1:3]
    assert state is F and "already bound to another decode" in reason
    sender.send(6, 0, 22, last=True, aux=(1, -1.0))
    assert Results(a).get(6)[1] is S and Results(sender).get(6)[1] is S
    assert not b.pools[0].k[0].any()  # nothing was written into the second decode


def test_deadlines_and_bootstrap_errors(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, cfg=dataclasses.replace(CFG, bootstrap_timeout_s=0.3))
    recv = start_decode(stack, fabric=fabric, cfg=dataclasses.replace(CFG, waiting_timeout_s=0.5))
    sender = prefill.senders[0]
    rs, rr = Results(sender), Results(recv)
    sender.add_room(1, SRC)  # no decode ever asks for it
    assert "bootstrapping timed out" in rs.get(1, timeout=5)[2]
    recv.add_room(2, "127.0.0.1", prefill.port, np.arange(6), prefix_len=0)  # prefill never admits it
    state, reason = rr.get(2, timeout=5)[1:3]
    assert state is F and "waiting_for_input timed out" in reason
    sender.add_room(2, SRC)  # admitted too late: fails at once, the decode already gave up
    assert rs.get(2, timeout=5)[1] is F
    assert sender.num_active_rooms() == 0 and recv.num_active_rooms() == 0
    impatient = start_decode(stack, fabric=fabric, cfg=dataclasses.replace(CFG, bootstrap_timeout_s=0.5))
    with socket_port() as dead:
        impatient.add_room(3, "127.0.0.1", dead, np.arange(6), prefix_len=0)
        state, reason = Results(impatient).get(3, timeout=5)[1:3]
    assert state is F and f"bootstrap with prefill 127.0.0.1:{dead} failed" in reason and "unreachable" in reason


@contextlib.contextmanager
def socket_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    yield port


def test_incompatible_decode_is_refused_clearly(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric)
    recv = start_decode(stack, fabric=fabric, model="other-model")
    recv.add_room(1, "127.0.0.1", prefill.port, np.arange(6), prefix_len=0)
    state, reason = Results(recv).get(1, timeout=5)[1:3]
    assert state is F and "served model name: prefill 'm', decode 'other-model'" in reason


def test_write_failure_fails_both_sides(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, inject=FaultInjection(prob=1.0, seed=3))
    recv = start_decode(stack, fabric=fabric)
    sender = prefill.senders[0]
    sender.add_room(1, SRC)
    recv.add_room(1, "127.0.0.1", prefill.port, np.arange(6), prefix_len=0)
    sender.send(1, 0, 22, last=True, aux=(1, 0.0))
    assert "injected failure" in Results(sender).get(1)[2]
    state, reason = Results(recv).get(1)[1:3]
    assert state is F and "injected failure" in reason
    assert sender.stats.batches_failed >= 1
