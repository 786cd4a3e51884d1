"""KVSender <-> KVReceiver rigs in one process: per-rank KV pools (or MLA latent pools) filled
with known data, real bootstrap servers and ZMQ, local and Mooncake (loopback TCP) backends,
prefill and decode sides of any TP size, and the checks of where the bytes landed. What a test
starts goes on its ExitStack (the `stack` fixture of tests/integration/conftest.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import DisaggregationConfig, FaultInjection, TransferTuning
from kvpipe.transfer.backends.base import TransferBackend
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric
from kvpipe.transfer.control.auth import authenticator
from kvpipe.transfer.control.bootstrap import BootstrapServer
from kvpipe.transfer.control.messages import AuxData, DecodeRank
from kvpipe.transfer.kv_digest import KVDigester
from kvpipe.transfer.lifecycle import Clock, TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.tp_mapping import kv_head_range
from kvpipe.transfer.receiver.kv_receiver import KVReceiver
from kvpipe.transfer.sender.kv_sender import KVSender
from kvpipe.transfer.staging.buffers import KVBytes, StagingAgent, StagingBuffer

L, PAGES, PS, HD, H = 2, 32, 4, 8, 2  # layers, pages per pool, page size, head dim, total KV heads
# Heartbeat timeout 1 s: short for the tests, long enough for a loaded shared machine.
CFG = DisaggregationConfig(
    bootstrap_timeout_s=3.0,
    waiting_timeout_s=5.0,
    heartbeat_interval_s=0.1,
    heartbeat_misses=10,
    transfer_timeout_s=1.0,
    tuning=TransferTuning(http_timeout_s=1.0),
)

T = TypeVar("T")
# one poll() entry: a KVSender's (room, state, reason) or a KVReceiver's, with the prefill's aux data
Entry = tuple[int, TransferState, str] | tuple[int, TransferState, str, AuxData | None]


def wait_for(fn: Callable[[], T | None], timeout: float = 10.0, what: str = "condition") -> T:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Results:
    """Collects poll() output of one manager; `get(room)` waits for that room."""

    def __init__(self, mgr: KVSender | KVReceiver) -> None:
        self.mgr = mgr
        self.seen: dict[int, Entry] = {}

    def _pull(self) -> dict[int, Entry]:
        for entry in self.mgr.poll():
            assert entry[0] not in self.seen, f"room {entry[0]} reported twice"
            self.seen[entry[0]] = entry
        return self.seen

    def get(self, room: int, timeout: float = 10.0) -> Entry:
        wait_for(lambda: room in self._pull(), timeout, f"room {room}")
        return self.seen[room]

    def absent(self, room: int) -> bool:
        return room not in self._pull()


def make_backend(
    kind: str, fabric: LocalFabric, stack: contextlib.ExitStack, inject: FaultInjection | None = None
) -> TransferBackend:
    if kind == "mooncake":
        pytest.importorskip("mooncake.engine")
        from kvpipe.transfer.backends.mooncake import MooncakeBackend

        backend: TransferBackend = MooncakeBackend("127.0.0.1", inject=inject)
    else:
        backend = LocalBackend(fabric, inject=inject)
    stack.callback(backend.close)
    return backend


LATENT_DIM = 12  # an MLA latent row (kv_lora_rank + rope dims) of the latent-pool tests


def truth(seed: int = 0, latent: bool = False, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Full-head KV per (layer, K/V): [PAGES, H, PS, HD] each, layer-major, K then V; or one MLA
    latent per layer, [PAGES, 1, PS, LATENT_DIM]; in the pools' dtype."""
    g = torch.Generator().manual_seed(seed)
    if latent:
        return [torch.randn(PAGES, 1, PS, LATENT_DIM, generator=g).to(dtype) for _ in range(L)]
    return [torch.randn(PAGES, H, PS, HD, generator=g).to(dtype) for _ in range(2 * L)]


def rank_pool(
    tp: int, rank: int, data: list[torch.Tensor] | None, latent: bool = False, dtype: torch.dtype = torch.float32
) -> tuple[KVPool, KVLayout]:
    heads = 1 if latent else H  # the latent is one head that every rank holds whole
    h0, h1 = kv_head_range(tp, rank, heads)
    pool = KVPool(L, PAGES, PS, h1 - h0, LATENT_DIM if latent else HD, dtype, latent=latent)
    if data is not None:
        for buf, full in zip(pool.buffers(), data):
            buf.copy_(full[:, h0:h1])
    return pool, KVLayout.from_pool(pool, head_start=h0, total_kv_heads=heads)


def register(backend: TransferBackend, layout: KVLayout) -> None:
    backend.register_many(list(layout.buffer_addrs), [layout.buffer_nbytes] * layout.num_buffers)


class RigSender(KVSender):
    """A KVSender that holds its rank's pool: the memory it registered by address lives as long
    as the sender (the stack closes it)."""

    pool: KVPool


class RigReceiver(KVReceiver):
    """A KVReceiver that holds what its tests check: each decode rank's pool (and staging agent,
    where it offers staging). Like RigSender's, the pools live as long as the receiver."""

    pools: list[KVPool]
    agents: list[StagingAgent]


@dataclasses.dataclass
class Prefill:
    server: BootstrapServer
    senders: list[KVSender]
    data: list[torch.Tensor]

    @property
    def port(self) -> int:
        return self.server.port


def start_prefill(
    stack: contextlib.ExitStack,
    kind: str = "local",
    fabric: LocalFabric | None = None,
    tp: int = 1,
    cfg: DisaggregationConfig = CFG,
    server: BootstrapServer | None = None,
    instance: str = "p0",
    seed: int = 0,
    inject: FaultInjection | None = None,
    latent: bool = False,
    on_news: Callable[[], None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Prefill:
    """cfg.staging other than "off": each rank gets a local staging buffer of cfg.staging_pool_nbytes."""
    fabric = fabric or LocalFabric()
    if server is None:
        # the bootstrap signs its answers with the same token (a decode with one refuses unsigned
        # answers); the ranks register with the server's own registrar key, as a prefill's do
        server = stack.enter_context(
            BootstrapServer("127.0.0.1", 0, auth=authenticator(cfg.auth_token), registrar_key=secrets.token_bytes(32))
        )
    data = truth(seed, latent, dtype)
    senders: list[KVSender] = []
    for rank in range(tp):
        pool, layout = rank_pool(tp, rank, data, latent, dtype)
        backend = make_backend(kind, fabric, stack, inject)
        register(backend, layout)
        buf = None if cfg.staging == "off" else StagingBuffer(KVBytes.from_pool(pool), backend, cfg.staging_pool_nbytes)
        s = RigSender(
            cfg,
            layout=layout,
            backend=backend,
            tp_rank=rank,
            tp_size=tp,
            model_name="m",
            instance_id=instance,
            staging=buf,
            on_news=on_news,
            digester=KVDigester(pool.buffers(), layout),
        )
        s.pool = pool  # keep the memory alive as long as the sender
        stack.callback(s.close)
        senders.append(s.start(("127.0.0.1", server.port), server.registrar_key))
    return Prefill(server, senders, data)


def start_decode(
    stack: contextlib.ExitStack,
    kind: str = "local",
    fabric: LocalFabric | None = None,
    tp: int = 1,
    cfg: DisaggregationConfig = CFG,
    clock: Clock = time.monotonic,
    model: str = "m",
    staging_nbytes: int | None = None,
    latent: bool = False,
    dtype: torch.dtype = torch.float32,
) -> RigReceiver:
    """staging_nbytes: every rank offers a staging ring of that size (recv.agents)."""
    fabric = fabric or LocalFabric()
    pools: list[KVPool] = []
    ranks: list[DecodeRank] = []
    agents: list[StagingAgent] = []
    for rank in range(tp):
        pool, layout = rank_pool(tp, rank, None, latent, dtype)
        backend = make_backend(kind, fabric, stack)
        register(backend, layout)
        pools.append(pool)
        info = None
        if staging_nbytes is not None:
            agent = StagingAgent(
                layout,
                KVBytes.from_pool(pool),
                backend,
                staging_nbytes,
                host="127.0.0.1",
                session_id=f"d/{rank}",
                lease_s=2 * cfg.transfer_timeout_s,
            ).start()
            stack.callback(agent.close)
            agents.append(agent)
            info = agent.info
        ranks.append(DecodeRank(layout, backend.address, info))
    digester = KVDigester(pools[0].buffers(), ranks[0].layout) if cfg.kv_integrity else None
    recv = RigReceiver(cfg, ranks=ranks, model_name=model, clock=clock, digester=digester)
    recv.pools, recv.agents = pools, agents
    stack.callback(recv.close)
    recv.start()
    return recv


def assert_moved(prefill: Prefill, recv: RigReceiver, src: np.ndarray, dst: np.ndarray, untouched: np.ndarray) -> None:
    """Decode pages `dst` hold prefill pages `src` for every decode rank's heads; `untouched` stay zero."""
    for rank, pool in enumerate(recv.pools):
        h0, h1 = kv_head_range(len(recv.pools), rank, 1 if pool.latent else H)
        for full, buf in zip(prefill.data, pool.buffers(), strict=True):
            raw = buf.view(torch.uint8)  # compared as bytes: any pool dtype, fp8 included
            assert torch.equal(raw[dst], full[src][:, h0:h1].contiguous().view(torch.uint8))
            assert not raw[untouched].any()


SRC = np.array([3, 4, 5, 9, 10, 11])  # prefill page table of a 22-token prompt (page size 4)
