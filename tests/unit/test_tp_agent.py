"""A TP child's KV transfer agent in-process, the test speaking rank 0's side of the agent channel:
start-up (backend, pool registration, a KVSender registered with a real bootstrap server), calls
replayed on the child's sender, rooms reported back, refusals reported instead of lost, clean stop."""

from __future__ import annotations

import socket
from multiprocessing.connection import Connection
from typing import Iterator

import numpy as np
import pytest

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import CacheConfig, DisaggregationConfig, ServerConfig
from kvpipe.engine.tp_agent import (AbortRoom, AddRoom, AgentFailed, AgentReady, AgentStart, ChildAgent, CloseAgent,
                                    RoomsDone, SendKV)
from kvpipe.transfer.bootstrap import BootstrapServer, fetch_prefill_rank
from kvpipe.transfer.state import TransferState

PAGES, PS = 16, 4


def cfg(mode: str) -> ServerConfig:
    return ServerConfig("m", tp_size=2, cache=CacheConfig(page_size=PS, num_pages=PAGES),
                        disaggregation=DisaggregationConfig(mode=mode, transfer_backend="local", bootstrap_port=0))


def start_agent(mode: str) -> tuple[ChildAgent, Connection]:
    mine, theirs = socket.socketpair()
    pool = KVPool(2, PAGES, PS, 1, 8)  # rank 1 of TP 2 over 2 KV heads: one head
    agent = ChildAgent(cfg(mode), 1, pool, 2, Connection(theirs.detach())).start()
    return agent, Connection(mine.detach())


def recv(conn: Connection, timeout_s: float = 10.0) -> object:
    assert conn.poll(timeout_s), "the agent sent nothing"
    return conn.recv()


def done_rooms(conn: Connection, n: int) -> list[tuple[int, TransferState, str]]:
    out: list = []
    for _ in range(100):
        if len(out) >= n:
            break
        msg = recv(conn)
        assert isinstance(msg, RoomsDone) and msg.rank == 1, msg
        out += msg.results
    return out


@pytest.fixture
def bootstrap() -> Iterator[BootstrapServer]:
    with BootstrapServer("127.0.0.1", 0) as srv:
        yield srv


def test_prefill_agent_registers_and_replays_calls(bootstrap: BootstrapServer) -> None:
    agent, conn = start_agent("prefill")
    try:
        conn.send(AgentStart("inst-1", ("127.0.0.1", bootstrap.port)))
        ready = recv(conn)
        assert isinstance(ready, AgentReady) and ready.rank == 1
        assert (ready.layout.head_start, ready.layout.kv_heads, ready.layout.total_kv_heads) == (1, 1, 2)
        info = fetch_prefill_rank("127.0.0.1", bootstrap.port, 1)
        assert (info.instance_id, info.tp_size, info.control_address) == ("inst-1", 2, ready.control_address)
        assert agent.sender is not None and agent.sender.session_id == "inst-1/1"

        conn.send(AddRoom(5, np.arange(3)))
        conn.send(SendKV(5, 0, 8, 0, None, False, None, None))
        conn.send(AbortRoom(5, "decode went away"))
        conn.send(AddRoom(6, np.array([PAGES + 1])))  # outside the pool: refused, reported failed
        conn.send(SendKV(6, 0, 4, 0, None, True, (1, -0.5), None))  # for a room the sender never had
        results = dict((room, (state, why)) for room, state, why in done_rooms(conn, 2))
        assert results[5] == (TransferState.FAILED, "decode went away")
        assert results[6][0] is TransferState.FAILED and "add_room refused" in results[6][1]
        assert agent.sender.num_active_rooms() == 0
        conn.send(CloseAgent())
        agent._thread.join(5)  # noqa: SLF001
        assert not agent._thread.is_alive()  # noqa: SLF001
    finally:
        agent.close()
        conn.close()


def test_decode_agent_reports_its_destination_and_an_unexpected_call_fails_it() -> None:
    agent, conn = start_agent("decode")
    try:
        conn.send(AgentStart())
        ready = recv(conn)
        assert isinstance(ready, AgentReady) and ready.control_address is None
        assert ready.data_address == agent.backend.address and ready.layout.head_start == 1
        assert ready.layout.num_pages == PAGES
        conn.send(AddRoom(1, np.arange(2)))  # a decode rank has no sender
        failed = recv(conn)
        assert isinstance(failed, AgentFailed) and "no KV sender" in failed.text
        agent._thread.join(5)  # noqa: SLF001
        assert not agent._thread.is_alive()  # noqa: SLF001
    finally:
        agent.close()
        conn.close()
