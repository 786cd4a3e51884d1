"""The two process bodies of the heterogeneous-TP mode of `kvpipe bench transfer` (--prefill-tp /
--decode-tp / --staging), run by process_pair.py.

Each process is over real Mooncake engines (one per rank) and the real control plane: the
prefill process runs KVSenders with their bootstrap servers, the decode process KVReceivers, the
decode ranks' pools and (when staging is on) their staging agents. Per prompt length and repeat,
three variants move the same request, in rotating order:
  same    one prefill rank -> one decode rank, all KV heads: the same bytes as whole pages
  plain   P prefill ranks -> D decode ranks, head slices written op by op
  staged  the same pairing through the decode ranks' staging rings (--staging on|auto)
Each is timed from the prefill's send() to every prefill rank reporting Success (the decode's
scatters acknowledged), after the decode's TransferRequest arrived; ops are the senders' submitted
Mooncake ops. The decode process checks every destination page against the source KV.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvpipe.bench.rotation import rotated
from kvpipe.bench.transfer.config import TPConfig
from kvpipe.bench.transfer.messages import (
    AddRoom,
    CheckRoom,
    ProtocolError,
    Quit,
    ReceiversReady,
    RoomAdded,
    RoomChecked,
)
from kvpipe.bench.transfer.pages import fragmented_pages
from kvpipe.bench.transfer.process_pair import Peer
from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import DisaggregationConfig
from kvpipe.disagg.setup import register_pool
from kvpipe.transfer.backends.mooncake import MooncakeBackend
from kvpipe.transfer.control.bootstrap import BootstrapServer
from kvpipe.transfer.control.messages import DecodeRank
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.tp_mapping import kv_head_range
from kvpipe.transfer.receiver.kv_receiver import KVReceiver
from kvpipe.transfer.sender.kv_sender import KVSender
from kvpipe.transfer.staging.buffers import KVBytes, StagingAgent, StagingBuffer

VARIANTS = ("same", "plain", "staged")
Rank = tuple[KVPool, KVLayout, MooncakeBackend]


def _truth(cfg: TPConfig) -> list[torch.Tensor]:
    """Full-head KV per (layer, K/V), [pages, heads, page_size, head_dim]: equal in both processes."""
    g = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    return [
        torch.randn(cfg.max_pages, cfg.kv_heads, cfg.page_size, cfg.head_dim, generator=g).to(dtype)
        for _ in range(2 * cfg.num_layers)
    ]


def _ranks(
    cfg: TPConfig, tp: int, num_pages: int, truth: list[torch.Tensor] | None, backends: list[MooncakeBackend]
) -> list[Rank]:
    """A pool per rank holding its head slice (filled from `truth` when given), registered with a
    new Mooncake engine (appended to `backends`, which the caller closes)."""
    out = []
    for rank in range(tp):
        h0, h1 = kv_head_range(tp, rank, cfg.kv_heads)
        pool = KVPool(cfg.num_layers, num_pages, cfg.page_size, h1 - h0, cfg.head_dim, getattr(torch, cfg.dtype))
        if truth is not None:
            for buf, full in zip(pool.buffers(), truth):
                buf.copy_(full[:, h0:h1])
        layout = KVLayout.from_pool(pool, h0, cfg.kv_heads)
        backend = MooncakeBackend(hostname=cfg.hostname, protocol="tcp", window=cfg.window)
        register_pool(backend, layout)
        backends.append(backend)
        out.append((pool, layout, backend))
    return out


def _disagg(cfg: TPConfig, staging: str) -> DisaggregationConfig:
    return DisaggregationConfig(
        staging=staging,
        staging_pool_mb=cfg.staging_pool_mb,
        bootstrap_timeout_s=60.0,
        transfer_timeout_s=60.0,
        heartbeat_interval_s=2.0,
        # no token between the benchmark's own processes: its decode fetches from the prefill's
        # address on the link it made (network namespaces, qa/testbed.py), not only loopback
        insecure=True,
    )


class _Receivers:
    """The decode's two receiver groups: 'same' (TP 1, all heads) and 'tp' (decode_tp ranks with
    staging agents), and what each room expects."""

    def __init__(self, cfg: TPConfig, backends: list[MooncakeBackend], closers: list[Callable[[], None]]) -> None:
        self.cfg = cfg
        self.truth = _truth(cfg)
        pool_pages = cfg.max_pages * (2 if cfg.fragmentation > 0 else 1)
        d = _disagg(cfg, cfg.staging)
        self.recvs: dict[str, KVReceiver] = {}
        self.pools: dict[str, list[KVPool]] = {}
        for name, tp in (("same", 1), ("tp", cfg.decode_tp)):
            made = _ranks(cfg, tp, pool_pages, None, backends)
            ranks = []
            for rank, (pool, lay, be) in enumerate(made):
                info = None
                if name == "tp":
                    agent = StagingAgent(
                        lay,
                        KVBytes.from_pool(pool),
                        be,
                        d.staging_pool_nbytes,
                        host=cfg.hostname,
                        session_id=f"bench/{rank}",
                        lease_s=120.0,
                    ).start()
                    closers.append(agent.close)
                    info = agent.info
                ranks.append(DecodeRank(lay, be.address, info))
            self.recvs[name] = KVReceiver(d, ranks=ranks, model_name="bench", host=cfg.hostname).start()
            closers.append(self.recvs[name].close)
            self.pools[name] = [pool for pool, _, _ in made]
        self.rooms: dict[int, tuple[str, np.ndarray]] = {}

    def add(self, msg: AddRoom) -> None:
        which = "same" if msg.variant == "same" else "tp"
        r = self.recvs[which]
        r.add_room(msg.room, self.cfg.prefill_host, msg.bootstrap_port, [msg.pages] * r.tp_size)
        self.rooms[msg.room] = (which, msg.pages)

    def check(self, msg: CheckRoom) -> bool:
        """The room succeeded and every decode rank holds its heads of the source pages (then zeroed,
        so the next room must land again to verify)."""
        which, pages = self.rooms.pop(msg.room)
        end, got = time.monotonic() + 120, None
        while got is None and time.monotonic() < end:
            got = next((x for x in self.recvs[which].poll() if x[0] == msg.room), None)
            time.sleep(0.001)
        if got is None or got[1] is not TransferState.SUCCESS:
            return False
        ok = True
        tp = len(self.pools[which])
        idx, sidx = torch.as_tensor(pages), torch.as_tensor(msg.src_pages)
        for rank, pool in enumerate(self.pools[which]):
            h0, h1 = kv_head_range(tp, rank, self.cfg.kv_heads)
            bufs = pool.buffers()
            ok = ok and all(torch.equal(b[idx], full[sidx][:, h0:h1]) for b, full in zip(bufs, self.truth))
            for b in bufs:
                b[idx] = 0
        return ok


def decode_main(cfg: TPConfig, peer: Peer) -> None:
    """Receivers for the 'same' and the heterogeneous pools; adds and checks rooms until Quit."""
    torch.set_num_threads(1)  # two processes on a small box: one thread each
    backends: list[MooncakeBackend] = []
    closers: list[Callable[[], None]] = []
    try:
        receivers = _Receivers(cfg, backends, closers)
        peer.send(ReceiversReady())
        while True:
            msg = peer.recv()
            if isinstance(msg, AddRoom):
                receivers.add(msg)
                peer.send(RoomAdded())
            elif isinstance(msg, CheckRoom):
                peer.send(RoomChecked(receivers.check(msg)))
            elif isinstance(msg, Quit):
                break
            else:
                raise ProtocolError(f"the decode got {type(msg).__name__}")
    finally:
        for close in reversed(closers):
            close()
        for b in backends:
            b.close()


class _Senders:
    """Per variant: a bootstrap server and the prefill ranks' KVSenders over pools of `truth`."""

    def __init__(self, cfg: TPConfig, backends: list[MooncakeBackend], closers: list[Callable[[], None]]) -> None:
        truth = _truth(cfg)
        self.groups: dict[str, list[KVSender]] = {}
        self.ports: dict[str, int] = {}
        self.pools: list[KVPool] = []  # the senders' memory, alive as long as they are
        for variant, tp in (("same", 1), ("plain", cfg.prefill_tp), ("staged", cfg.prefill_tp)):
            d = _disagg(cfg, cfg.staging if variant == "staged" else "off")
            server = BootstrapServer(cfg.hostname, 0).start()
            closers.append(server.close)
            self.ports[variant] = server.port
            self.groups[variant] = []
            for rank, (pool, lay, be) in enumerate(_ranks(cfg, tp, cfg.max_pages, truth, backends)):
                buf = StagingBuffer(KVBytes.from_pool(pool), be, d.staging_pool_nbytes) if variant == "staged" else None
                s = KVSender(
                    d,
                    layout=lay,
                    backend=be,
                    tp_rank=rank,
                    tp_size=tp,
                    model_name="bench",
                    instance_id=f"bench-{variant}",
                    host=cfg.hostname,
                    staging=buf,
                )
                self.pools.append(pool)
                closers.append(s.close)
                self.groups[variant].append(s.start((cfg.hostname, server.port)))


def _await_requests(group: list[KVSender], room: int, src: np.ndarray, variant: str, end: float) -> None:
    """Add the room on every prefill rank and wait for the decode's TransferRequest."""
    for s in group:
        s.add_room(room, src)
    while any(s.room_state(room) is TransferState.BOOTSTRAPPING for s in group):
        if time.monotonic() > end:
            raise RuntimeError(f"{variant}: the decode's request never arrived")
        time.sleep(0.0005)


def _send_all(group: list[KVSender], room: int, n_tokens: int, variant: str, end: float) -> float:
    """Seconds from send() until every prefill rank reported the room's Success."""
    t0 = time.perf_counter()
    for s in group:
        s.send(room, 0, n_tokens, last=True, aux=(1, 0.0))
    left = set(range(len(group)))
    while left:
        for i in list(left):
            for got in group[i].poll():
                if got[0] == room:
                    if got[1] is not TransferState.SUCCESS:
                        raise RuntimeError(f"{variant} room failed: {got[2]}")
                    left.discard(i)
        if time.monotonic() > end:
            raise RuntimeError(f"{variant}: transfer timed out")
        time.sleep(0.0002)
    return time.perf_counter() - t0


def prefill_main(cfg: TPConfig, peer: Peer) -> dict[str, Any]:
    torch.set_num_threads(1)  # two processes on a small box: one thread each
    backends: list[MooncakeBackend] = []
    closers: list[Callable[[], None]] = []
    try:
        senders = _Senders(cfg, backends, closers)
        peer.expect(ReceiversReady)
        rng = np.random.default_rng(cfg.seed)
        room = 1
        per_len = []
        for n_tokens in cfg.prompt_lens:
            n = -(-n_tokens // cfg.page_size)
            src = np.arange(n, dtype=np.int64)
            dst = fragmented_pages(n, cfg.fragmentation, rng)
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            ops: dict[str, list[int]] = {v: [] for v in VARIANTS}
            nbytes: dict[str, int] = {}
            verified = True
            for r in range(cfg.repeat + 1):  # the first round registers peers: not timed
                for variant in rotated(VARIANTS, r):
                    group = senders.groups[variant]
                    peer.ask(AddRoom(variant, room, senders.ports[variant], dst), RoomAdded)
                    end = time.monotonic() + 60
                    _await_requests(group, room, src, variant, end)
                    before = [(s.stats.ops_submitted, s.stats.bytes_written) for s in group]
                    dt = _send_all(group, room, n_tokens, variant, end)
                    verified = peer.ask(CheckRoom(room, src), RoomChecked).ok and verified
                    if r > 0:
                        times[variant].append(dt)
                        ops[variant].append(sum(s.stats.ops_submitted - b[0] for s, b in zip(group, before)))
                        nbytes[variant] = sum(s.stats.bytes_written - b[1] for s, b in zip(group, before))
                    room += 1
            med = {v: statistics.median(times[v]) for v in VARIANTS}
            per_len.append(
                {
                    "prompt_len": n_tokens,
                    "pages": n,
                    "bytes": nbytes["same"],
                    **{f"{v}_ms": med[v] * 1e3 for v in VARIANTS},
                    **{f"{v}_ops": int(statistics.median(ops[v])) for v in VARIANTS},
                    **{f"{v}_gbps": nbytes[v] / med[v] / 1e9 for v in VARIANTS},
                    "staged_vs_same": med["staged"] / med["same"],
                    "plain_vs_same": med["plain"] / med["same"],
                    "op_reduction": statistics.median(ops["plain"]) / max(1, statistics.median(ops["staged"])),
                    "equal_bytes": len(set(nbytes.values())) == 1,
                    "verified": verified,
                }
            )
        return {"lengths": per_len}
    finally:
        for close in reversed(closers):
            close()
        for b in backends:
            b.close()
