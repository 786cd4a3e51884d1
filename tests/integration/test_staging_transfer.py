"""Heterogeneous-TP transfer through the decode's staging ring (transfer/staging/buffers.py), KVSender <->
KVReceiver in one process over the local backend and Mooncake: the bytes land exactly where plain
page writes put them, with one op per staged chunk; chunked and layer-grouped sends, a decode
prefix, a ring smaller than a request (writers wait and resume), aborts and write failures free
every slot on both sides."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvpipe.config import FaultInjection
from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.lifecycle import TransferState
from tests.helpers.kv_transfer import (
    CFG,
    HD,
    PAGES,
    PS,
    SRC,
    H,
    L,
    Results,
    assert_moved,
    start_decode,
    start_prefill,
    wait_for,
)

S, F = TransferState.SUCCESS, TransferState.FAILED
STAGED = dataclasses.replace(CFG, staging="on", staging_pool_mb=1)


def rings_empty(recv, prefill) -> bool:
    return all(a.usage() == (0, 0, 0) for a in recv.agents) and all(
        s._book.staged.local_ring.num_live == 0 for s in prefill.senders
    )


def s_heads(tp: int) -> int:
    """KV heads one rank holds at this TP size (replicated past H)."""
    return max(1, H // tp)


def run_room(prefill, recv, room: int, dst: np.ndarray, d_tp: int, groups: bool = False) -> None:
    recv.add_room(room, "127.0.0.1", prefill.port, [dst] * d_tp, prefix_len=4)
    for s in prefill.senders:
        s.add_room(room, SRC)
        if groups:  # layer-pipelined: each layer group ships on its own, the last call flushes
            s.send(room, 0, 21, 0, 1)
            s.send(room, 0, 21, 1, 2, last=True, aux=(3, -0.5))
        else:  # chunked: two chunks
            s.send(room, 0, 10)
            s.send(room, 10, 21, last=True, aux=(3, -0.5))


@pytest.mark.parametrize(
    "p_tp, d_tp, groups", [(1, 2, False), (2, 1, True), (1, 4, False), (4, 1, False), (2, 4, True), (4, 2, False)]
)
def test_staged_heterogeneous_tp_moves_the_same_bytes(stack, p_tp, d_tp, groups):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, tp=p_tp, cfg=STAGED)
    recv = start_decode(stack, fabric=fabric, tp=d_tp, staging_nbytes=1 << 20)
    dst = np.array([1, 2, 3, 12, 13])
    run_room(prefill, recv, 9, dst, d_tp, groups)
    for s in prefill.senders:
        assert Results(s).get(9)[1:] == (S, "")
    assert Results(recv).get(9)[1] is S
    assert_moved(prefill, recv, SRC[1:], dst, np.setdiff1d(np.arange(PAGES), dst))
    senders = [s for s in prefill.senders if s.stats.ops_submitted]
    sliced = s_heads(p_tp) != s_heads(d_tp)  # else a destination holds whole pages: plain coalesced writes
    for s in senders:  # one op per staged chunk instead of 2 x layers x pages
        assert s.stats.staged_chunks == (s.stats.ops_submitted if sliced else 0) and s.stats.ops_submitted, s.stats
    assert wait_for(lambda: rings_empty(recv, prefill), 5, "every staging slot freed")


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1)])  # head-sliced both ways
def test_staged_fp8_pools_move_the_same_bytes(stack, p_tp, d_tp):
    """1-byte elements (--kv-cache-dtype fp8_e4m3): staged chunks gather and scatter head slices
    at byte offsets of the fp8 layout, landing every byte where page writes would, ring freed."""
    fabric = LocalFabric()
    fp8 = torch.float8_e4m3fn
    prefill = start_prefill(stack, fabric=fabric, tp=p_tp, cfg=STAGED, dtype=fp8)
    recv = start_decode(stack, fabric=fabric, tp=d_tp, staging_nbytes=1 << 20, dtype=fp8)
    dst = np.array([1, 2, 3, 12, 13])
    run_room(prefill, recv, 9, dst, d_tp)
    assert Results(recv).get(9)[1] is S
    assert_moved(prefill, recv, SRC[1:], dst, np.setdiff1d(np.arange(PAGES), dst))
    assert all(s.stats.staged_chunks for s in prefill.senders if s.stats.ops_submitted)
    assert sum(s.stats.bytes_written for s in prefill.senders) == (len(SRC) - 1) * PS * HD * 2 * L * H
    assert wait_for(lambda: rings_empty(recv, prefill), 5, "every staging slot freed")


def test_a_ring_smaller_than_the_request_makes_writers_wait_and_resume(stack):
    """4 prefill ranks share decode rank 0's ring of 4 chunk slots: slots are reused many times."""
    cfg = dataclasses.replace(STAGED, staging_pool_mb=1)
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, tp=4, cfg=cfg)
    recv = start_decode(stack, fabric=fabric, tp=1, staging_nbytes=1024)  # chunks of 256 B: one page-layer
    for room in range(20, 26):
        run_room(prefill, recv, room, np.array([1, 2, 3, 12, 13]) + room % 2 * 14, 1)
    got = Results(recv)
    for room in range(20, 26):
        assert got.get(room, 20)[1] is S
    assert_moved(prefill, recv, SRC[1:], np.array([15, 16, 17, 26, 27]), np.array([0, 4, 5, 28, 31]))
    agent = recv.agents[0]
    assert agent.stats.waited > 0 and agent.stats.scattered == agent.stats.granted
    assert wait_for(lambda: rings_empty(recv, prefill), 5, "every staging slot freed")


def test_a_chunk_larger_than_the_ring_fails_the_room_clearly(stack):
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, tp=2, cfg=STAGED)
    recv = start_decode(stack, fabric=fabric, tp=1, staging_nbytes=256)  # a ring smaller than one slice x 4
    run_room(prefill, recv, 30, np.array([1, 2, 3, 12, 13]), 1)
    room, state, reason, _ = Results(recv).get(30)
    assert state is F
    s_state, s_reason = Results(prefill.senders[0]).get(30)[1:]
    assert s_state is F and "larger than the staging chunk limit" in s_reason
    assert wait_for(lambda: rings_empty(recv, prefill), 5, "every staging slot freed")


@pytest.mark.parametrize("kind", ["local", "mooncake"])
def test_write_failures_and_aborts_free_every_slot(stack, kind):
    """30% of writes fail (at most 3 per rank: some of the 8 rooms not aborted succeed), and every
    third room is aborted by the decode mid-way: each room ends Success with the right bytes or
    Failed, and both sides' staging memory comes back whole."""
    fabric = LocalFabric()
    inject = FaultInjection(0.3, seed=5, max_failures=3)
    prefill = start_prefill(stack, kind, fabric=fabric, tp=2, cfg=STAGED, inject=inject)
    recv = start_decode(stack, kind, fabric=fabric, tp=1, staging_nbytes=4096)
    states, got, sent = {}, Results(recv), [Results(s) for s in prefill.senders]
    for room in range(40, 52):
        dst = np.array([1, 2, 3, 12, 13])
        run_room(prefill, recv, room, dst, 1)
        if room % 3 == 0:
            recv.abort(room, "client went away")
        states[room] = got.get(room, 20)[1]
        for r in sent:
            r.get(room, 20)
        if states[room] is S:
            assert_moved(prefill, recv, SRC[1:], dst, np.array([0, 4, 5]))
    assert F in states.values() and S in states.values()
    assert wait_for(lambda: rings_empty(recv, prefill), 5, "every staging slot freed")
    assert recv.num_active_rooms() == 0 and all(s.num_active_rooms() == 0 for s in prefill.senders)
