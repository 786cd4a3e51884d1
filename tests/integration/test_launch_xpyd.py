"""`kvpipe launch --prefills 2 --decodes 2` (start_pd_stack's xPyD stack): four servers behind one
sglang-router serve greedy requests identical to a colocated engine, every server takes part
(round_robin on both sides), the layout printed at start lists the four workers with the cores
their processes really have, and each server is named in its /metrics by its part name."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpipe.engine.cpu_threads import format_cores
from kvpipe.launch.start import start_pd_stack
from tests.helpers.pd_parity import colocated_reference, prompts
from tests.helpers.pd_stack import generate, greedy, wait_for
from tests.helpers.server import ServerProc
from tests.helpers.tolerance import Generation, Route, assert_same_generations

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.timeout(300)

PAGE = 16
LENGTHS = [5, 17, 40, 33, 64, 9, 80, 23]  # 8 requests: each of the 2 prefills and 2 decodes gets some
NEW = 6


def test_2p2d_serves_like_colocated(tiny_model_dir: Path, tmp_path: Path) -> None:
    ids = prompts(LENGTHS, seed=11)
    expected = colocated_reference(tiny_model_dir, ids, NEW, PAGE)
    flags = ["--page-size", str(PAGE), "--max-total-tokens", "4096"]
    with start_pd_stack(
        str(tiny_model_dir),
        server_args=flags,
        log_dir=str(tmp_path),
        timeout_s=180.0,
        prefills=2,
        decodes=2,
        prefill_policy="round_robin",
        decode_policy="round_robin",
    ) as stack:
        layout = stack.layout_lines()
        workers = [line.split()[0] for line in layout[1:-1]]
        assert layout[0] == "layout: 2P2D" and workers == ["prefill0", "prefill1", "decode0", "decode1"], layout
        for url in [*stack.prefill_urls, *stack.decode_urls]:
            assert sum(f"{url} (" in line for line in layout) == 1, (url, layout)
        assert "round_robin" in layout[-1] and stack.router_url in layout[-1]
        assert len(set(stack.bootstrap_ports)) == 2
        for i, line in enumerate(layout[1:5]):  # the cores each server process really has (issue 47)
            cores = format_cores(sorted(os.sched_getaffinity(stack.procs[i].pid)))
            pinned = "pinned" if stack.specs[i].pin else "not pinned"
            assert line.endswith(f", cores {cores} ({pinned}))"), (line, cores)

        def one(p: list[int]) -> Generation:
            return Generation.of(
                generate(stack.router_url, {"input_ids": p, "sampling_params": greedy(NEW), "return_logprob": True})
            )

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, ids))
        assert_same_generations(got, expected, Route.ACROSS_PROCESSES, ids, "2P2D through the router")
        for i, spec in enumerate(stack.specs[:4]):  # round_robin: every server took requests
            srv = ServerProc(spec.health_url.removesuffix("/health"), stack.procs[i], tmp_path / f"{spec.name}.log")
            assert srv.metric("kvpipe_prompt_tokens_total") > 0, spec.name
            assert srv.metric("kvpipe_worker_info", f'name="{spec.name}"') == 1  # --worker-name: its part name


@pytest.mark.slow  # ~75 s: five processes; the fast suite has test_kv_store_tier.py and the plain 2P2D above
def test_2p2d_with_the_kv_tier_reuses_a_prefix_on_the_other_prefill_and_decode(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`launch` with --enable-hierarchical-cache starts mooncake_master itself. With round_robin on
    both sides the second request of a prompt reaches the other prefill and the other decode (its
    radix cache on): both load the pages the first pair stored instead of computing / receiving
    them (cached_tokens through the router), and the output is the same."""
    pytest.importorskip("mooncake.store")
    flags = ["--page-size", str(PAGE), "--max-total-tokens", "4096"]
    tier = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
    tier += ["--hicache-mooncake-global-segment-size", "32mb", "--hicache-mooncake-local-buffer-size", "16mb"]
    tier += ["--hicache-store-fetch-timeout", "10"]  # a loaded test machine: no timeout fallbacks
    with start_pd_stack(
        str(tiny_model_dir),
        server_args=[*flags, *tier],
        decode_args=["--disaggregation-enable-decode-radix-cache"],
        log_dir=str(tmp_path),
        timeout_s=180.0,
        prefills=2,
        decodes=2,
        prefill_policy="round_robin",
        decode_policy="round_robin",
    ) as stack:
        assert stack.store_master is not None and stack.layout_lines()[-1].split()[0] == "store"
        servers = {
            spec.name: ServerProc(spec.health_url.removesuffix("/health"), stack.proc(spec.name), tmp_path / "x.log")
            for spec in stack.specs[:4]
        }

        def tier_stats(prefix: str, key: str) -> list[int]:
            return sorted(s.engine_stats()["kv_store"][key] for n, s in servers.items() if n.startswith(prefix))

        ids = prompts([90], seed=12)[0]  # 5 whole pages in the 89 tokens a match looks at
        body = {"input_ids": ids, "sampling_params": greedy(NEW), "return_logprob": True}
        first = generate(stack.router_url, body)
        assert first["meta_info"]["cached_tokens"] == 0
        wait_for(lambda: sum(tier_stats("prefill", "pages_put")) >= 5, 30, "the prefill's pages in the store")
        second = generate(stack.router_url, body)
        assert second["meta_info"]["cached_tokens"] == 5 * PAGE, second["meta_info"]
        assert tier_stats("prefill", "pages_fetched") == [0, 5]  # the other prefill loaded them
        assert tier_stats("decode", "pages_fetched") == [0, 5]  # and so did the other decode
        assert_same_generations([Generation.of(second)], [Generation.of(first)], Route.ACROSS_PROCESSES, [ids])
