"""`kvpipe bench kv-store --workload multiturn` (bench/kv_store/routing.py): the workload is
conversations of shared-prefix turns, every case runs it, and bytes moved count the PD transfer and
every server's store traffic in pages of that server's size."""

from __future__ import annotations

import argparse

from kvpipe.bench.kv_store import goodput as kv_store_goodput
from kvpipe.bench.kv_store import routing as kv_store_routing
from kvpipe.bench.kv_store.routing import CASES, _bytes_moved, workload


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    kv_store_routing.add_args(p)
    kv_store_goodput.add_args(p)
    return p.parse_args(list(argv))


def test_the_workload_is_shared_prefix_conversations() -> None:
    wl = workload(args("--conversations", "4", "--turns", "3", "--shared-prefix", "32", "--first-turn", "48"), 500)
    reqs = wl.requests
    assert len(reqs) == 12
    firsts = [r for r in reqs if r.follows is None]
    assert len(firsts) == 4 and all(len(r.prompt) == 48 for r in firsts)
    # conversations 0 and 2 share prefix group 0, 1 and 3 group 1; the groups differ
    assert firsts[0].prompt[:32] == firsts[2].prompt[:32] != firsts[1].prompt[:32] == firsts[3].prompt[:32]
    assert firsts[0].prompt[32:] != firsts[2].prompt[32:]
    follow = [r for r in reqs if r.follows is not None]
    assert all(len(r.prompt) == 64 and reqs[r.follows].index == r.index - 1 for r in follow)
    # the acceptance compares cache_aware + store on 2P2D with one 1P1D instance
    names = [c.name for c in CASES]
    assert names[0] == "1P1D" and "2P2D cache_aware + store" in names and "2P2D round_robin" in names


def test_bytes_moved_count_pd_and_store_pages() -> None:
    prefill = {
        "disaggregation": {"bytes_written": 1000},
        "kv_cache_bytes": 64 * 100,
        "total_pages": 100,
        "kv_store": {"pages_put": 3, "pages_fetched": 2},
    }
    decode = {"kv_cache_bytes": 32 * 10, "total_pages": 10, "kv_store": {"pages_put": 1, "pages_fetched": 4}}
    got = _bytes_moved([prefill], [prefill, decode])
    assert got == {
        "pd_transfer_bytes": 1000,
        "store_put_bytes": 3 * 64 + 32,
        "store_fetched_bytes": 2 * 64 + 4 * 32,
        "total": 1000 + 3 * 64 + 32 + 2 * 64 + 4 * 32,
    }
    assert _bytes_moved([{"disaggregation": {"bytes_written": 5}}], [{}])["total"] == 5  # no tier: PD only
