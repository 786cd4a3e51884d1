"""Heterogeneous-TP mode of `kvpipe bench transfer` (--prefill-tp / --decode-tp / --staging).

Two processes, each over real Mooncake engines (one per rank) and the real control plane: the
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

import os
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

VARIANTS = ("same", "plain", "staged")


@dataclass(frozen=True)
class TPConfig:
    num_layers: int
    kv_heads: int  # total KV heads of the model
    head_dim: int
    dtype: str
    page_size: int
    prompt_lens: tuple[int, ...]
    repeat: int
    fragmentation: float
    window: int
    seed: int
    log_path: str
    prefill_tp: int
    decode_tp: int
    staging: str  # "on" | "auto": the staged variant's mode
    staging_pool_mb: int
    prefill_host: str  # where the decode reaches the prefill's bootstrap servers
    hostname: str = "127.0.0.1"
    netns: str | None = None

    @property
    def max_pages(self) -> int:
        return -(-max(self.prompt_lens) // self.page_size)


def _truth(cfg: TPConfig, torch):
    """Full-head KV per (layer, K/V), [pages, heads, page_size, head_dim]: equal in both processes."""
    g = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    return [
        torch.randn(cfg.max_pages, cfg.kv_heads, cfg.page_size, cfg.head_dim, generator=g).to(dtype)
        for _ in range(2 * cfg.num_layers)
    ]


def _enter(cfg: TPConfig):
    fd = os.open(cfg.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    if cfg.netns:
        from kvpipe.qa.testbed import enter_netns

        enter_netns(cfg.netns)
    import torch

    torch.set_num_threads(1)  # two processes on a small box: one thread each
    return torch


def _ranks(cfg: TPConfig, tp: int, num_pages: int, truth, backends: list):
    """A pool per rank holding its head slice (filled from `truth` when given), registered with a
    new Mooncake engine (appended to `backends`, which the caller closes); returns
    [(pool, layout, backend)] per rank."""
    import torch

    from kvpipe.cache.kv_pool import KVPool
    from kvpipe.disagg.setup import register_pool
    from kvpipe.transfer.backends.mooncake import MooncakeBackend
    from kvpipe.transfer.planning.layout import KVLayout
    from kvpipe.transfer.planning.tp_mapping import kv_head_range

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


def _disagg(cfg: TPConfig, staging: str):
    from kvpipe.config import DisaggregationConfig

    return DisaggregationConfig(
        staging=staging,
        staging_pool_mb=cfg.staging_pool_mb,
        bootstrap_timeout_s=60.0,
        transfer_timeout_s=60.0,
        heartbeat_interval_s=2.0,
    )


def decode_main(cfg: TPConfig, conn: Connection) -> None:
    """Receivers for the 'same' (TP 1, all heads) and the heterogeneous (decode_tp ranks, with
    staging agents) pools; answers ("add", variant, room, port, pages) and ("check", room, src)."""
    torch = _enter(cfg)
    from kvpipe.transfer.lifecycle import TransferState
    from kvpipe.transfer.planning.tp_mapping import kv_head_range
    from kvpipe.transfer.receiver.kv_receiver import DecodeRank, KVReceiver
    from kvpipe.transfer.staging.buffers import KVBytes, StagingAgent

    backends: list = []
    closers: list = []
    try:
        truth = _truth(cfg, torch)
        pool_pages = cfg.max_pages * (2 if cfg.fragmentation > 0 else 1)
        d = _disagg(cfg, cfg.staging)
        recvs, pools = {}, {}
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
            recvs[name] = KVReceiver(d, ranks=ranks, model_name="bench", host=cfg.hostname).start()
            closers.append(recvs[name].close)
            pools[name] = [pool for pool, _, _ in made]
        conn.send("ready")
        rooms: dict[int, tuple[str, np.ndarray]] = {}
        while True:
            cmd = conn.recv()
            if cmd[0] == "add":
                _, variant, room, port, pages = cmd
                which = "same" if variant == "same" else "tp"
                r = recvs[which]
                r.add_room(room, cfg.prefill_host, port, [pages] * r.tp_size)
                rooms[room] = (which, pages)
                conn.send("ok")
            elif cmd[0] == "check":
                _, room, src = cmd
                which, pages = rooms.pop(room)
                end, got = time.monotonic() + 120, None
                while got is None and time.monotonic() < end:
                    got = next((x for x in recvs[which].poll() if x[0] == room), None)
                    time.sleep(0.001)
                ok = got is not None and got[1] is TransferState.SUCCESS
                if ok:  # every decode rank holds its heads of the source pages
                    tp = len(pools[which])
                    idx, sidx = torch.as_tensor(pages), torch.as_tensor(src)
                    for rank, pool in enumerate(pools[which]):
                        h0, h1 = kv_head_range(tp, rank, cfg.kv_heads)
                        bufs = pool.buffers()
                        ok = ok and all(torch.equal(b[idx], full[sidx][:, h0:h1]) for b, full in zip(bufs, truth))
                        for b in bufs:
                            b[idx] = 0  # the next room must land again to verify
                conn.send((ok, None if got is None else got[2]))
            else:
                break
    finally:
        for close in reversed(closers):
            close()
        for b in backends:
            b.close()


def prefill_main(cfg: TPConfig, conn: Connection, parent: Connection) -> None:
    try:
        parent.send(("result", _prefill(cfg, conn)))
    except BaseException as e:
        parent.send(("error", f"{type(e).__name__}: {e}"))
        raise
    finally:
        conn.send(("quit",))


def _prefill(cfg: TPConfig, conn: Connection) -> dict[str, Any]:
    torch = _enter(cfg)
    from kvpipe.bench.transfer_procs import fragmented_pages
    from kvpipe.transfer.control.bootstrap import BootstrapServer
    from kvpipe.transfer.lifecycle import TransferState
    from kvpipe.transfer.sender.kv_sender import KVSender
    from kvpipe.transfer.staging.buffers import KVBytes, StagingBuffer

    backends: list = []
    closers: list = []
    try:
        truth = _truth(cfg, torch)
        senders: dict[str, list[KVSender]] = {}
        ports: dict[str, int] = {}
        for variant, tp in (("same", 1), ("plain", cfg.prefill_tp), ("staged", cfg.prefill_tp)):
            d = _disagg(cfg, cfg.staging if variant == "staged" else "off")
            server = BootstrapServer(cfg.hostname, 0).start()
            closers.append(server.close)
            ports[variant] = server.port
            senders[variant] = []
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
                s.pool = pool  # keep the memory alive with the sender
                closers.append(s.close)
                senders[variant].append(s.start((cfg.hostname, server.port)))
        assert conn.recv() == "ready"
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
                order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
                for variant in order:
                    group = senders[variant]
                    conn.send(("add", variant, room, ports[variant], dst))
                    conn.recv()
                    end = time.monotonic() + 60
                    for s in group:
                        s.add_room(room, src)
                    while any(s.room_state(room) is TransferState.BOOTSTRAPPING for s in group):
                        if time.monotonic() > end:
                            raise RuntimeError(f"{variant}: the decode's request never arrived")
                        time.sleep(0.0005)
                    before = [(s.stats.ops_submitted, s.stats.bytes_written) for s in group]
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
                    dt = time.perf_counter() - t0
                    conn.send(("check", room, src))
                    ok, _ = conn.recv()
                    verified = verified and ok
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


def summarize(result: dict[str, Any], cfg: TPConfig, link_rate: str | None) -> dict[str, Any]:
    lengths = result["lengths"]
    return {
        "mode": "tp",
        "lengths": lengths,
        "verified": all(x["verified"] and x["equal_bytes"] for x in lengths),
        "config": {
            "layers": cfg.num_layers,
            "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "dtype": cfg.dtype,
            "page_size": cfg.page_size,
            "repeat": cfg.repeat,
            "fragmentation": cfg.fragmentation,
            "window": cfg.window,
            "prefill_tp": cfg.prefill_tp,
            "decode_tp": cfg.decode_tp,
            "staging": cfg.staging,
            "staging_pool_mb": cfg.staging_pool_mb,
            "link_rate": link_rate or "loopback",
        },
    }


def format_table(report: dict[str, Any]) -> str:
    c = report["config"]
    rows = [
        f"TP {c['prefill_tp']} -> {c['decode_tp']}, KV {c['layers']}L x {c['kv_heads']}H x {c['head_dim']}D "
        f"{c['dtype']}, page {c['page_size']}, fragmentation {c['fragmentation']}, staging {c['staging']} "
        f"({c['staging_pool_mb']} MB), link {c['link_rate']}, median of {c['repeat']}",
        f"{'tokens':>7} {'MiB':>7} {'same ms':>8} {'plain ms':>9} {'staged ms':>10} {'same ops':>9} "
        f"{'plain ops':>10} {'staged ops':>11} {'staged/same':>12} {'ops /':>6} ok",
    ]
    for x in report["lengths"]:
        rows.append(
            f"{x['prompt_len']:>7} {x['bytes'] / 2**20:>7.1f} {x['same_ms']:>8.2f} {x['plain_ms']:>9.2f} "
            f"{x['staged_ms']:>10.2f} {x['same_ops']:>9} {x['plain_ops']:>10} {x['staged_ops']:>11} "
            f"{x['staged_vs_same']:>12.2f} {x['op_reduction']:>6.1f} "
            f"{'yes' if x['verified'] and x['equal_bytes'] else 'NO'}"
        )
    return "\n".join(rows)
