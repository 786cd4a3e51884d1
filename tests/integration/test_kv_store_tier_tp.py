"""The KV tier with tensor parallelism, in PD through sglang-router at prefill/decode TP (1,2) and
(2,1), next to a colocated TP 2 server sharing the store: every TP rank puts and loads its own head
slice under its own keys, and the ranks load the same pages.

A prompt the colocated server computed reaches the PD stack's TP 2 side through the store (its
ranks load the pages the other instance's ranks put; the PD side computes / sends the rest), and a
prompt the PD stack computed reaches the colocated server the same way. Greedy tokens and logprobs
equal a TP 1 engine's without the tier or any cache (Route.ACROSS_PROCESSES: TP sums round
differently); a head slice loaded onto the wrong rank, or a rank that loaded other pages than the
others, changes them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpipe.cache.store_client import MooncakeStoreClient, MooncakeStoreSpec
from kvpipe.cache.store_keys import StoreNamespace, page_keys
from kvpipe.launch.process import stop_process
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.identity import checkpoint_digest
from tests.helpers.mooncake_store import Master, running_master
from tests.helpers.pd_parity import colocated_reference, prompts
from tests.helpers.pd_stack import TP_FLAGS, TP_PS, close_and_check_no_orphans, generate, greedy, start_stack, wait_for
from tests.helpers.server import ServerProc, start_server
from tests.helpers.tolerance import Generation, Route, assert_same_generations

pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.timeout(420)

PS, NEW = TP_PS, 4
PAGES = 5  # whole pages in the 89 tokens a match of a 90-token prompt looks at


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    with running_master(tmp_path_factory.mktemp("mooncake")) as m:
        yield m


@pytest.fixture(scope="module")
def colocated(master: Master, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """Another instance: a colocated TP 2 server on the same store."""
    log = tmp_path_factory.mktemp("tier_tp") / "colocated.log"
    srv = start_server(tiny_model_dir, log, *TP_FLAGS[:4], "--tp-size", "2", *master.server_flags(), timeout_s=180)
    try:
        yield srv
    finally:
        stop_process(srv.proc)


def tp2_keys(model_dir: Path, ids: list[int]) -> list[str]:
    """Both TP 2 ranks' keys of the prompt's PAGES pages (fp32 pool, one KV head per rank)."""
    mc = model_config_of(str(model_dir))
    digest = checkpoint_digest(model_dir)
    heads = max(1, mc.kv_cache_heads // 2)
    out = []
    for rank in range(2):
        ns = StoreNamespace(digest, "torch.float32", PS, 2 * len(mc.kv_layers), heads, mc.kv_cache_head_dim, rank, 2)
        out += page_keys(ns, ids[: PAGES * PS])
    return out


def ask(url: str, ids: list[int]) -> dict:
    return generate(url, {"input_ids": ids, "sampling_params": greedy(NEW), "return_logprob": True})


def tier(srv: ServerProc) -> dict:
    return srv.engine_stats()["kv_store"]


# ~2 min a case here (seven processes); the fast suite has the unit test of the ranks' agreement
# (tests/unit/test_store_tier_prefetch.py) and the TP 1 tier tests (test_kv_store_tier.py)
@pytest.mark.slow
@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
def test_tp_ranks_share_prefixes_through_the_store(
    master: Master, colocated: ServerProc, tiny_model_dir: Path, tmp_path: Path, p_tp: int, d_tp: int
) -> None:
    x, y = prompts([90, 90], seed=40 + p_tp)  # fresh prompts per case: the store outlives a case
    want = colocated_reference(tiny_model_dir, [x, y], NEW, PS, radix_cache=False)
    client = MooncakeStoreClient(MooncakeStoreSpec(master.address, master.metadata_url, global_segment_bytes=16 << 20))
    stack = start_stack(
        tiny_model_dir,
        tmp_path,
        *TP_FLAGS,
        *master.server_flags(),
        prefill_args=("--tp-size", str(p_tp)),
        decode_args=("--tp-size", str(d_tp), "--disaggregation-enable-decode-radix-cache"),
    )
    tp2 = stack.prefill if p_tp == 2 else stack.decode  # the PD stack's TP 2 server
    try:
        # x: computed by the colocated instance, both its ranks' slices stored
        got_x_colocated = ask(colocated.url, x)
        keys_x = tp2_keys(tiny_model_dir, x)
        wait_for(lambda: all(client.exists(keys_x)), 60, "both ranks' pages of x in the store")
        fetched = tier(tp2)["pages_fetched"]
        got_x = ask(stack.router, x)  # the PD stack's TP 2 side loads them instead
        assert tier(tp2)["pages_fetched"] == fetched + PAGES, tier(tp2)
        if p_tp == 2:
            assert got_x["meta_info"]["cached_tokens"] == PAGES * PS, got_x["meta_info"]
        # y: computed by the PD stack, loaded by the colocated instance
        got_y = ask(stack.router, y)
        keys_y = tp2_keys(tiny_model_dir, y)
        wait_for(lambda: all(client.exists(keys_y)), 60, "both PD TP 2 ranks' pages of y in the store")
        fetched = tier(colocated)["pages_fetched"]
        got_y_colocated = ask(colocated.url, y)
        assert got_y_colocated["meta_info"]["cached_tokens"] == PAGES * PS, got_y_colocated["meta_info"]
        assert tier(colocated)["pages_fetched"] == fetched + PAGES
        got = [Generation.of(g) for g in (got_x_colocated, got_x, got_y, got_y_colocated)]
        assert_same_generations(
            got, [want[0], want[0], want[1], want[1]], Route.ACROSS_PROCESSES, [x, x, y, y], f"TP ({p_tp},{d_tp})"
        )
        assert sum(tier(tp2)["fallbacks"].values()) == 0, tier(tp2)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        client.close()
        close_and_check_no_orphans(stack)
