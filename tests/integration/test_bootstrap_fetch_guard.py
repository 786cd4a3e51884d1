"""Finding 2 of the second security pass, the fetch workers: bootstrap hosts named by clients
that accept a connection and never answer hold at most the decode's workers for unproven
addresses; a prefill the decode fetched from before (here: restarted) is fetched apart and its
request succeeds while every bogus fetch is still held; a bogus address that failed is then
refused without another fetch. Measured by counting connections and fetches, not by timing. In
one process (tests/helpers/kv_transfer.py): real bootstrap server, real ZMQ, local backend."""

from __future__ import annotations

import dataclasses
import socket
import threading

import numpy as np
import pytest

from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.bootstrap import BootstrapRefused, BootstrapServer
from kvpipe.transfer.lifecycle import TransferState
from tests.helpers.kv_transfer import CFG, SRC, Results, assert_moved, start_decode, start_prefill, wait_for

S, F, B = TransferState.SUCCESS, TransferState.FAILED, TransferState.BOOTSTRAPPING
UNPROVEN_WORKERS = 4  # KVReceiver's pool for addresses it never fetched from


class Blackhole:
    """A TCP port that accepts connections and never answers, until `release()` closes it all."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._released = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self._released.is_set():
                conn.close()
                return
            self.accepted.append(conn)

    def release(self) -> None:
        self._released.set()
        # shutdown wakes the blocked accept() and stops listening (close alone does neither on Linux)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for c in list(self.accepted):
            c.close()


def test_bogus_hosts_hold_no_worker_of_a_proven_prefill(stack) -> None:
    # an HTTP timeout and a negative cache far longer than the test: a held fetch stays held
    # until released, a failed address stays refused
    cfg = dataclasses.replace(
        CFG,
        bootstrap_timeout_s=60.0,
        transfer_timeout_s=60.0,
        tuning=dataclasses.replace(CFG.tuning, http_timeout_s=60.0, bootstrap_negative_ttl_s=600.0),
    )
    fabric = LocalFabric()
    server = stack.enter_context(BootstrapServer("127.0.0.1", 0))
    first = start_prefill(stack, fabric=fabric, server=server, instance="first", cfg=cfg)
    recv = start_decode(stack, fabric=fabric, cfg=cfg)
    rr = Results(recv)
    recv.add_room(1, "127.0.0.1", server.port, np.arange(6))  # the prefill answers: proven
    first.senders[0].add_room(1, SRC)
    first.senders[0].send(1, 0, 22, last=True, aux=(5, -1.0))
    assert rr.get(1)[1] is S
    # the prefill restarts: its old instance dies (heartbeats stop), a new one registers
    recv.add_room(2, "127.0.0.1", server.port, np.arange(6) + 6)
    wait_for(lambda: first.senders[0].room_state(2) is not None, 5, "request arrived")
    first.senders[0].close()
    wait_for(lambda: recv.room_state(2) is F, 5, "heartbeat death")
    second = start_prefill(stack, fabric=fabric, server=server, instance="second", seed=1, cfg=cfg)

    # clients name 8 bogus bootstrap hosts: the unproven workers are all held
    holes = [Blackhole() for _ in range(8)]
    try:
        for i, hole in enumerate(holes):
            recv.add_room(100 + i, "127.0.0.1", hole.port, np.arange(1) + 20)
        wait_for(lambda: sum(len(h.accepted) for h in holes) == UNPROVEN_WORKERS, 10, "held fetches")
        # the restarted prefill is fetched apart: its request goes through meanwhile
        recv.add_room(3, "127.0.0.1", server.port, np.arange(6) + 12)
        second.senders[0].add_room(3, SRC)
        second.senders[0].send(3, 0, 22, last=True, aux=(9, -2.0))
        assert rr.get(3)[1:] == (S, "", m.AuxData(3, 9, -2.0))
        assert_moved(second, recv, SRC, np.arange(6) + 12, np.arange(21, 32))
        assert sum(len(h.accepted) for h in holes) == UNPROVEN_WORKERS  # still held, none answered
        assert all(recv.room_state(100 + i) is B for i in range(len(holes)))
    finally:
        for hole in holes:
            hole.release()
    for i in range(len(holes)):  # every bogus fetch failed once: no answer, or refused
        assert rr.get(100 + i)[1] is F
    fetches = recv.stats.bootstrap_fetches
    for i, hole in enumerate(holes):  # ... and is not tried again for a while
        with pytest.raises(BootstrapRefused, match="not tried again"):
            recv.add_room(200 + i, "127.0.0.1", hole.port, np.arange(1) + 20)
    assert recv.stats.bootstrap_fetches == fetches
    # both sides hold nothing any more
    assert rr.get(2)[1] is F  # reported once the new instance proved the old one gone
    assert Results(second.senders[0]).get(3)[1] is S
    wait_for(lambda: recv.num_rooms() == 0, 10, "decode rooms released")
    wait_for(lambda: second.senders[0].num_rooms() == 0, 10, "prefill rooms released")
