"""KVSender <-> KVReceiver rigs in one process: per-rank KV pools (or MLA latent pools) filled
with known data, real bootstrap servers and ZMQ, local and Mooncake (loopback TCP) backends,
prefill and decode sides of any TP size, and the checks of where the bytes landed. What a test
starts goes on its ExitStack (the `stack` fixture of tests/integration/conftest.py)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import DisaggregationConfig, TransferTuning
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric
from kvpipe.transfer.control.bootstrap import BootstrapServer
from kvpipe.transfer.control.messages import DecodeRank
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


def wait_for(fn, timeout: float = 10.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Results:
    """Collects poll() output of one manager; `get(room)` waits for that room."""

    def __init__(self, mgr) -> None:
        self.mgr, self.seen = mgr, {}

    def _pull(self):
        for entry in self.mgr.poll():
            assert entry[0] not in self.seen, f"room {entry[0]} reported twice"
            self.seen[entry[0]] = entry
        return self.seen

    def get(self, room: int, timeout: float = 10.0):
        return wait_for(lambda: self._pull().get(room), timeout, f"room {room}")

    def absent(self, room: int) -> bool:
        return room not in self._pull()


def make_backend(kind: str, fabric: LocalFabric, stack, inject=None):
    if kind == "mooncake":
        pytest.importorskip("mooncake.engine")
        from kvpipe.transfer.backends.mooncake import MooncakeBackend

        backend = MooncakeBackend("127.0.0.1", inject=inject)
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
):
    heads = 1 if latent else H  # the latent is one head that every rank holds whole
    h0, h1 = kv_head_range(tp, rank, heads)
    pool = KVPool(L, PAGES, PS, h1 - h0, LATENT_DIM if latent else HD, dtype, latent=latent)
    if data is not None:
        for buf, full in zip(pool.buffers(), data):
            buf.copy_(full[:, h0:h1])
    return pool, KVLayout.from_pool(pool, head_start=h0, total_kv_heads=heads)


def register(backend, layout: KVLayout) -> None:
    backend.register_many(list(layout.buffer_addrs), [layout.buffer_nbytes] * layout.num_buffers)


@dataclasses.dataclass
class Prefill:
    server: BootstrapServer
    senders: list[KVSender]
    data: list[torch.Tensor]

    @property
    def port(self) -> int:
        return self.server.port


def start_prefill(
    stack,
    kind="local",
    fabric=None,
    tp=1,
    cfg=CFG,
    server=None,
    instance="p0",
    seed=0,
    inject=None,
    latent=False,
    on_news=None,
    dtype=torch.float32,
):
    """cfg.staging other than "off": each rank gets a local staging buffer of cfg.staging_pool_nbytes."""
    fabric = fabric or LocalFabric()
    if server is None:
        server = stack.enter_context(BootstrapServer("127.0.0.1", 0))
    data, senders = truth(seed, latent, dtype), []
    for rank in range(tp):
        pool, layout = rank_pool(tp, rank, data, latent, dtype)
        backend = make_backend(kind, fabric, stack, inject)
        register(backend, layout)
        buf = None if cfg.staging == "off" else StagingBuffer(KVBytes.from_pool(pool), backend, cfg.staging_pool_nbytes)
        s = KVSender(
            cfg,
            layout=layout,
            backend=backend,
            tp_rank=rank,
            tp_size=tp,
            model_name="m",
            instance_id=instance,
            staging=buf,
            on_news=on_news,
        )
        s.pool = pool  # keep the memory alive as long as the sender
        stack.callback(s.close)
        senders.append(s.start(("127.0.0.1", server.port)))
    return Prefill(server, senders, data)


def start_decode(
    stack,
    kind="local",
    fabric=None,
    tp=1,
    cfg=CFG,
    clock=time.monotonic,
    model="m",
    staging_nbytes: int | None = None,
    latent=False,
    dtype=torch.float32,
):
    """staging_nbytes: every rank offers a staging ring of that size (recv.agents)."""
    fabric = fabric or LocalFabric()
    pools, ranks, agents = [], [], []
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
    recv = KVReceiver(cfg, ranks=ranks, model_name=model, clock=clock)
    recv.pools, recv.agents = pools, agents
    stack.callback(recv.close)
    return recv.start()


def assert_moved(prefill: Prefill, recv: KVReceiver, src: np.ndarray, dst: np.ndarray, untouched: np.ndarray):
    """Decode pages `dst` hold prefill pages `src` for every decode rank's heads; `untouched` stay zero."""
    for rank, pool in enumerate(recv.pools):
        h0, h1 = kv_head_range(len(recv.pools), rank, 1 if pool.latent else H)
        for full, buf in zip(prefill.data, pool.buffers(), strict=True):
            raw = buf.view(torch.uint8)  # compared as bytes: any pool dtype, fp8 included
            assert torch.equal(raw[dst], full[src][:, h0:h1].contiguous().view(torch.uint8))
            assert not raw[untouched].any()


SRC = np.array([3, 4, 5, 9, 10, 11])  # prefill page table of a 22-token prompt (page size 4)
