"""Rank 0's side of PD KV transfer with TP > 1: start the TP children's transfer agents, build the
prefill's sender (one KVSender per rank behind a TPSender) and the decode's destination ranks.

Rank 0 keeps its own transfer objects (its KV shard, its backend); each child rank gets the same
from its agent (kvpipe/engine/tp_agent.py) over the agent channel TPGroup opened to it. With
TP = 1 these helpers return what a single rank needs and start nothing.
"""

from __future__ import annotations

import time
import uuid
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Sequence

from kvpipe.config import ServerConfig

from kvpipe.engine.tp_agent import AgentFailed, AgentReady, AgentStart, CloseAgent
from kvpipe.engine.tp_sender import TPSender
from kvpipe.transfer.backends.base import TransferBackend
from kvpipe.transfer.layout import KVLayout
from kvpipe.transfer.receiver import DecodeRank
from kvpipe.transfer.sender import KVSender

if TYPE_CHECKING:
    from kvpipe.engine.engine import Engine

AGENT_START_MARGIN_S = 30.0  # on top of the bootstrap timeout: backend start-up on a loaded host


def agent_conns(engine: "Engine") -> list[Connection]:
    group = engine.tp_group
    if group is None or not group.agent_conns:
        raise RuntimeError("this engine's TP children have no transfer agents (TPGroup started without "
                           "a disaggregation mode)")
    return group.agent_conns


def start_agents(conns: Sequence[Connection], start: AgentStart, timeout_s: float) -> list[AgentReady]:
    """Start the agent of every child (ranks 1..N-1, in order) and return their AgentReady."""
    for conn in conns:
        conn.send(start)
    out: list[AgentReady] = []
    deadline = time.monotonic() + timeout_s
    for rank, conn in enumerate(conns, start=1):
        try:
            while not conn.poll(0.05):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"TP rank {rank} did not start its KV transfer agent within {timeout_s:.0f}s")
            msg = conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"TP rank {rank} exited before its KV transfer agent started ({e!r})") from e
        if isinstance(msg, AgentFailed):
            raise RuntimeError(f"TP rank {rank} could not start its KV transfer agent:\n{msg.text}")
        if not isinstance(msg, AgentReady) or msg.rank != rank:
            raise RuntimeError(f"TP rank {rank} answered its agent start with {msg!r}")
        out.append(msg)
    return out


def _close_agents(conns: Sequence[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(CloseAgent())
        except (OSError, ValueError):
            pass


def make_sender(cfg: ServerConfig, engine: "Engine", layout: KVLayout, backend: TransferBackend, host: str,
                bootstrap: tuple[str, int]) -> KVSender | TPSender:
    """Rank 0's KVSender, registered with the bootstrap server; with TP > 1 every child starts
    its own (same instance id) and a TPSender drives them all."""
    instance_id = uuid.uuid4().hex[:12]
    local = KVSender(cfg.disaggregation, layout=layout, backend=backend, tp_rank=0, tp_size=cfg.tp_size,
                     model_name=cfg.model_name, instance_id=instance_id, host=host)
    local.start(bootstrap=bootstrap)
    if cfg.tp_size == 1:
        return local
    conns: Sequence[Connection] = ()
    try:
        conns = agent_conns(engine)
        start_agents(conns, AgentStart(instance_id, bootstrap),
                     cfg.disaggregation.bootstrap_timeout_s + AGENT_START_MARGIN_S)
        return TPSender(local, conns)
    except BaseException:
        _close_agents(conns)
        local.close()
        raise


def decode_ranks(cfg: ServerConfig, engine: "Engine", layout: KVLayout, backend: TransferBackend) -> list[DecodeRank]:
    """The decode instance's ranks as its KVReceiver sees them: rank 0's pool and backend, then
    each child's (its agent registered the child's pool with the child's own backend)."""
    ranks = [DecodeRank(layout, backend.address)]
    if cfg.tp_size > 1:
        conns = agent_conns(engine)
        try:
            ready = start_agents(conns, AgentStart(), cfg.disaggregation.bootstrap_timeout_s + AGENT_START_MARGIN_S)
        except BaseException:
            _close_agents(conns)
            raise
        ranks += [DecodeRank(r.layout, r.data_address) for r in ready]
    return ranks
