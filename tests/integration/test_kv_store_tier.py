"""The KV tier on Mooncake Store (--enable-hierarchical-cache --hicache-storage-backend mooncake):
two colocated servers share one store. B reuses a prefix A computed (cached_tokens > 0, the same
output); a corrupted or foreign record under a page's key is never loaded; with the master killed
every request still succeeds (computed), and stored prefixes are reused again once it is back."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpipe.cache.store_client import MooncakeStoreClient, MooncakeStoreSpec
from kvpipe.cache.store_keys import StoreNamespace, encode_page, page_keys
from kvpipe.launch.process import stop_process
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.identity import checkpoint_digest
from tests.helpers.mooncake_store import Master, running_master
from tests.helpers.pd_stack import generate, greedy, wait_for
from tests.helpers.server import ServerProc, start_server
from tests.helpers.tolerance import Generation, Route, assert_same_generations

pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.timeout(300)

PS = 16
NEW = 4


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    with running_master(tmp_path_factory.mktemp("mooncake")) as m:
        yield m


@pytest.fixture(scope="module")
def servers(
    master: Master, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProc, ServerProc]]:
    logs = tmp_path_factory.mktemp("tier")
    flags = ["--page-size", str(PS), "--max-total-tokens", "4096", "--cpu-threads", "1", *master.server_flags()]
    with ThreadPoolExecutor(2) as pool:  # both start at once: half the fixture's wait
        futures = [pool.submit(start_server, tiny_model_dir, logs / f"{n}.log", *flags) for n in "ab"]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            f.result()  # a server that did not start fails the fixture (the other is stopped below)
        yield started[0], started[1]
    finally:
        for srv in reversed(started):
            stop_process(srv.proc)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 290) for _ in range(n)]


def ask(srv: ServerProc, ids: list[int]) -> dict:
    return generate(srv.url, {"input_ids": ids, "sampling_params": greedy(NEW), "return_logprob": True})


def store_stats(srv: ServerProc) -> dict:
    return srv.engine_stats()["kv_store"]


def wait_put(srv: ServerProc, at_least: int) -> None:
    wait_for(lambda: store_stats(srv)["pages_put"] >= at_least, 30, f"{at_least} pages put by {srv.url}")


def test_b_reuses_the_prefix_a_computed(servers: tuple[ServerProc, ServerProc]) -> None:
    a, b = servers
    ids = prompt(100, seed=1)  # 6 whole pages of the 99 tokens a match looks at
    put_before = store_stats(a)["pages_put"]
    first = ask(a, ids)
    assert first["meta_info"]["cached_tokens"] == 0
    wait_put(a, put_before + 6)
    fetched_before = store_stats(b)["pages_fetched"]
    second = ask(b, ids)
    assert second["meta_info"]["cached_tokens"] == 6 * PS, second["meta_info"]
    assert store_stats(b)["pages_fetched"] == fetched_before + 6
    assert b.metric("kvpipe_kv_store_pages_total", 'event="fetched"') >= 6
    assert_same_generations([Generation.of(second)], [Generation.of(first)], Route.ACROSS_PROCESSES, [ids])


def _namespace(model_dir: Path) -> StoreNamespace:
    """The namespace the servers above key their pages in (fp32 pool, page size PS, TP 1)."""
    mc = model_config_of(str(model_dir))
    return StoreNamespace(
        checkpoint_digest(model_dir),
        "torch.float32",
        PS,
        2 * len(mc.kv_layers),
        mc.kv_cache_heads,
        mc.kv_cache_head_dim,
    )


def test_corrupted_or_foreign_pages_are_never_used(
    servers: tuple[ServerProc, ServerProc], master: Master, tiny_model_dir: Path
) -> None:
    a, b = servers
    ns = _namespace(tiny_model_dir)
    corrupt, foreign = prompt(70, seed=2), prompt(70, seed=3)
    # the test's own client lends the store a segment too: the records may live there, so it stays
    # connected until the servers have read them
    client = MooncakeStoreClient(MooncakeStoreSpec(master.address, master.metadata_url, global_segment_bytes=16 << 20))
    try:
        payload = ns.num_buffers * ns.kv_heads * PS * ns.head_dim * 4
        k_corrupt = page_keys(ns, corrupt)[0]
        blob = bytearray(encode_page(k_corrupt, bytes(payload)))
        blob[-1] ^= 0xFF  # one flipped bit of the payload: its digest no longer matches
        k_foreign = page_keys(ns, foreign)[0]
        other = page_keys(ns, prompt(70, seed=4))[0]
        # a valid record, of another page: it names another key than the one it is stored under
        client.put([k_corrupt, k_foreign], [bytes(blob), encode_page(other, bytes(payload))])
        assert client.exists([k_corrupt, k_foreign]) == [True, True]
        rejected = store_stats(b)["pages_rejected"]
        got = [ask(b, ids) for ids in (corrupt, foreign)]
        assert [g["meta_info"]["cached_tokens"] for g in got] == [0, 0]
        assert store_stats(b)["pages_rejected"] == rejected + 2
    finally:
        client.close()
    # what a server computes without the store: the same prompts on A, whose radix cache lacks them
    want = [ask(a, ids) for ids in (corrupt, foreign)]
    assert_same_generations(
        [Generation.of(g) for g in got], [Generation.of(w) for w in want], Route.ACROSS_PROCESSES, [corrupt, foreign]
    )


def test_master_killed_mid_run(servers: tuple[ServerProc, ServerProc], master: Master) -> None:
    a, b = servers
    master.kill()
    try:
        ids = prompt(60, seed=5)
        first = ask(a, ids)  # the store is gone: computed, not failed
        wait_for(lambda: sum(store_stats(a)["puts_dropped"].values()) > 0, 30, "A's put to fail")
        second = ask(b, ids)
        assert first["meta_info"]["finish_reason"]["type"] == second["meta_info"]["finish_reason"]["type"] == "length"
        assert second["meta_info"]["cached_tokens"] == 0
        assert_same_generations([Generation.of(second)], [Generation.of(first)], Route.ACROSS_PROCESSES, [ids])
        falls = store_stats(b)["fallbacks"]
        assert sum(falls.values()) > 0, falls
        assert b.metric("kvpipe_kv_store_fallbacks_total") >= 0  # the family renders with the store down
    finally:
        master.start()
    # back: once the clients reconnect, a new prefix A computes reaches B through the store again
    seeds = iter(range(100, 200))  # a fresh prompt per try: B's own radix cache never holds it

    def round_trip() -> bool:
        ids = prompt(80, next(seeds))  # 5 pages stored by A, 4 of them within B's match
        put = store_stats(a)["pages_put"]
        ask(a, ids)
        try:
            wait_for(lambda: store_stats(a)["pages_put"] >= put + 5, 5, "A's put")
        except AssertionError:
            return False
        return ask(b, ids)["meta_info"]["cached_tokens"] == 4 * PS

    wait_for(round_trip, 90, "a prefix A computed to be reused on B after the restart", interval_s=0.5)
    assert store_stats(b)["up"]
