"""Issue 45, finding 10b: with --disaggregation-kv-integrity a page of a decode's KV pool that a
third party overwrites after the transfer (and before the first decode step reads it) fails that
request, with a clear error, and no other request. The write comes from a bare Mooncake client,
as the issue's attacker's did (the data plane has no credential), or straight into the pool on the
local backend; without the option the same write goes unnoticed (the negative control). In one
process: real bootstrap server and ZMQ, tests/helpers/kv_transfer.py."""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack

import numpy as np
import pytest

from kvpipe.transfer.backends.base import BatchState
from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.sender.kv_sender import KVSender
from tests.helpers.corrupt_kv import KVCorruption
from tests.helpers.kv_transfer import (
    CFG,
    SRC,
    Results,
    RigReceiver,
    make_backend,
    start_decode,
    start_prefill,
    wait_for,
)

S, F = TransferState.SUCCESS, TransferState.FAILED
VICTIM, BYSTANDER = np.arange(6), np.arange(6) + 8  # the decode pages of the two rooms


def two_rooms_landed(stack: ExitStack, kind: str, integrity: bool) -> tuple[RigReceiver, KVSender]:
    """Rooms 1 (into VICTIM) and 2 (into BYSTANDER) transferred: every prefill rank said Success,
    and the decode has not reported them yet (no decode step could have read their KV)."""
    cfg = dataclasses.replace(CFG, kv_integrity=integrity)
    fabric = LocalFabric()
    prefill = start_prefill(stack, kind=kind, fabric=fabric, cfg=cfg)
    recv = start_decode(stack, kind=kind, fabric=fabric, cfg=cfg)
    sender = prefill.senders[0]
    for room, dst in ((1, VICTIM), (2, BYSTANDER)):
        recv.add_room(room, "127.0.0.1", prefill.port, dst)
        sender.add_room(room, SRC)
        sender.send(room, 0, 22, last=True, aux=(5, -0.5))
    wait_for(lambda: recv.room_state(1) is S and recv.room_state(2) is S, 10, "both rooms landed")
    return recv, sender


def outcome(recv: RigReceiver, sender: KVSender) -> dict[int, tuple[TransferState, str]]:
    """How the decode reports both rooms; the prefill, which wrote them both, reports Success."""
    results, sent = Results(recv), Results(sender)
    assert [sent.get(room)[1] for room in (1, 2)] == [S, S]
    return {room: results.get(room)[1:3] for room in (1, 2)}  # type: ignore[misc]


@pytest.mark.parametrize("integrity", [True, False])
def test_a_page_overwritten_on_the_local_backend_fails_that_request_only(stack: ExitStack, integrity: bool) -> None:
    recv, sender = two_rooms_landed(stack, "local", integrity)
    KVCorruption(layer=1, page=2).apply(recv.pools[0], VICTIM)  # one page of one layer, K and V
    got = outcome(recv, sender)
    assert got[2] == (S, "")
    if integrity:
        assert got[1][0] is F and "KV integrity check failed" in got[1][1] and "prefill rank 0" in got[1][1]
        assert recv.stats.integrity_failed == 1
    else:  # the negative control: nothing notices
        assert got[1] == (S, "")
    assert recv.num_rooms() == 0 and sender.num_rooms() == 0


def test_a_bare_mooncake_client_writing_into_the_decodes_pool_fails_that_request_only(stack: ExitStack) -> None:
    pytest.importorskip("mooncake.engine")
    recv, sender = two_rooms_landed(stack, "mooncake", True)
    attacker = make_backend("mooncake", LocalFabric(), stack)  # a bare client: no token, no session
    junk = np.full(4096, 0x7F, dtype=np.uint8)
    attacker.register(junk.ctypes.data, junk.nbytes)
    layout = recv.ranks[0].layout
    dst = layout.buffer_addrs[0] + int(VICTIM[3]) * layout.page_nbytes  # layer 0's K, the room's 4th page
    handle = attacker.submit(recv.ranks[0].data_address, [junk.ctypes.data], [dst], [min(4096, layout.page_nbytes)])
    end = time.monotonic() + 10
    while (state := attacker.poll(handle)) is BatchState.PENDING and time.monotonic() < end:
        time.sleep(0.01)
    assert state is BatchState.DONE  # the data plane took the write: Mooncake has no credential
    got = outcome(recv, sender)
    assert got[1][0] is F and "KV integrity check failed" in got[1][1], got
    assert got[2] == (S, "")
    assert recv.num_rooms() == 0 and sender.num_rooms() == 0


def test_with_two_prefill_ranks_each_digest_covers_its_heads(stack: ExitStack) -> None:
    """Prefill TP 2 into decode TP 1: each prefill rank's digest covers the head it sent; a write
    into one head's slice is pinned on the rank that sent that head."""
    cfg = dataclasses.replace(CFG, kv_integrity=True)
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, tp=2, cfg=cfg)
    recv = start_decode(stack, fabric=fabric, cfg=cfg)
    for room, dst in ((1, VICTIM), (2, BYSTANDER)):
        recv.add_room(room, "127.0.0.1", prefill.port, dst)
        for s in prefill.senders:
            s.add_room(room, SRC)
            s.send(room, 0, 22, last=True, aux=(5, -0.5))
    wait_for(lambda: recv.room_state(1) is S and recv.room_state(2) is S, 10, "both rooms landed")
    KVCorruption(layer=0, page=1, head=1).apply(recv.pools[0], VICTIM)
    results = Results(recv)
    assert results.get(2)[1:3] == (S, "")
    state, reason = results.get(1)[1:3]
    assert state is F and "prefill rank 1 wrote (heads 1-1)" in reason, reason
    for sent in map(Results, prefill.senders):
        assert [sent.get(room)[1] for room in (1, 2)] == [S, S]
    assert recv.num_rooms() == 0 and all(s.num_rooms() == 0 for s in prefill.senders)
