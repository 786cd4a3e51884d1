"""`kvpipe bench kv-store --workload goodput`: the KV tier's put and get goodput against raw Mooncake
Store calls of the same sizes, one process, one mooncake_master on loopback.

The tier side is one rank's RankStore (cache/store_rank.py) over a KV pool of the model's geometry:
a put is `store_pages` until its put thread has stored every page (pool read, record encoding,
batch_is_exist, put_batch), a get is `start_fetch` + `write_fetched` (batch_is_exist, get_batch,
record check, pool write). The raw side calls put_batch / get_batch of MooncakeDistributedStore
with values of the records' sizes. Each round uses fresh keys; the two sides alternate which goes
first. Goodput = payload bytes (pages x page bytes) / wall time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.store_client import MooncakeStoreClient, MooncakeStoreSpec
from kvpipe.cache.store_keys import StoreNamespace, encode_page
from kvpipe.cache.store_pages import PoolPages
from kvpipe.cache.store_rank import RankStore, TierSettings
from kvpipe.launch.ports import free_ports
from kvpipe.launch.process import stop_process, wait_healthy
from kvpipe.launch.stack import PartSpec
from kvpipe.launch.store_master import StoreMaster
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.identity import checkpoint_digest


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--workload goodput")
    g.add_argument("--goodput-pages", type=int, default=16, help="pages of one put / get")


def _wait(cond: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("the tier did not finish within 120 s")
        time.sleep(0.0005)


def run_goodput(args: argparse.Namespace, model: str, log_dir: str) -> dict[str, Any]:
    mc = model_config_of(model)
    n, ps = args.goodput_pages, args.page_size
    pool = KVPool(len(mc.kv_layers), n, ps, mc.kv_cache_heads, mc.kv_cache_head_dim, dtype=torch.float32)
    for b in pool.buffers():
        b.normal_()
    ns = StoreNamespace(
        checkpoint_digest(model), "torch.float32", ps, len(pool.buffers()), mc.kv_cache_heads, mc.kv_cache_head_dim
    )
    pages = PoolPages(pool)
    master = StoreMaster("127.0.0.1", *free_ports(3))
    proc = PartSpec("store", tuple(master.command()), master.health_url, os.path.join(log_dir, "store.log")).spawn()
    rows: list[dict[str, float]] = []
    try:
        wait_healthy(master.health_url, 60.0, [proc])
        addr, meta = master.server_flags()[1], master.server_flags()[3]
        seg = 2 * n * (pages.payload_bytes + 4096) * (args.rounds + 1)
        buf = 2 * n * (pages.payload_bytes + 4096)

        def spec() -> MooncakeStoreSpec:
            return MooncakeStoreSpec(addr, meta, global_segment_bytes=seg, local_buffer_bytes=buf)

        settings = TierSettings(max_batch_bytes=buf // 2, fetch_timeout_s=60.0)
        tier = RankStore(ns, pages, lambda: MooncakeStoreClient(spec()), settings)
        raw = MooncakeStoreClient(spec())._store  # the raw MooncakeDistributedStore
        record = len(encode_page(tier.keys([0] * ps, 0, 1)[0], bytes(pages.payload_bytes)))
        rng = random.Random(0)
        page_ids = torch.arange(n).numpy()
        payload = n * pages.payload_bytes
        for r in range(args.rounds):
            ids = [rng.randrange(3, 30000) for _ in range(n * ps)]
            raw_keys = [f"raw-{r}-{i}" for i in range(n)]
            values = [os.urandom(16) * (record // 16) + os.urandom(record % 16) for _ in range(n)]
            row: dict[str, float] = {}
            for side in ("tier", "raw") if r % 2 == 0 else ("raw", "tier"):
                if side == "tier":
                    put0 = tier.stats()["pages_put"]
                    t0 = time.perf_counter()
                    tier.store_pages(ids, page_ids)
                    _wait(lambda put0=put0: tier.stats()["pages_put"] >= put0 + n)
                    row["tier_put_s"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    tier.start_fetch(f"r{r}", tier.keys(ids, 0, n))
                    _wait(lambda r=r: tier.fetch_result(f"r{r}") is not None)
                    got = tier.fetch_result(f"r{r}")
                    tier.write_fetched(f"r{r}", page_ids[: got or 0])
                    row["tier_get_s"] = time.perf_counter() - t0
                    row["tier_got_pages"] = float(got or 0)
                else:
                    t0 = time.perf_counter()
                    rc = raw.put_batch(raw_keys, values)
                    row["raw_put_s"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    back = raw.get_batch(raw_keys)
                    row["raw_get_s"] = time.perf_counter() - t0
                    row["raw_ok"] = float(rc == 0 and all(len(v) == record for v in back))
            rows.append(row)
            if not args.json:
                print(
                    f"round {r}: put tier {payload / row['tier_put_s'] / 1e9:.2f} GB/s raw "
                    f"{payload / row['raw_put_s'] / 1e9:.2f} GB/s; get tier {payload / row['tier_get_s'] / 1e9:.2f} "
                    f"GB/s raw {payload / row['raw_get_s'] / 1e9:.2f} GB/s",
                    flush=True,
                )
        tier.close()
    finally:
        stop_process(proc)

    def gbps(key: str) -> float:
        return payload / statistics.median(r[key] for r in rows) / 1e9

    out = {k: gbps(f"{k}_s") for k in ("tier_put", "raw_put", "tier_get", "raw_get")}
    return {
        "pages": n,
        "page_bytes": pages.payload_bytes,
        "record_bytes": record,
        "rounds": rows,
        "goodput_gb_s": out,
        "put_ratio": out["tier_put"] / out["raw_put"],
        "get_ratio": out["tier_get"] / out["raw_get"],
        "all_pages_loaded": all(r["tier_got_pages"] == n for r in rows),
        "raw_ok": all(r["raw_ok"] == 1.0 for r in rows),
    }
