"""Service back soon after a heal (issue 50): a PD stack across the testbed's link (tiny preset,
prefill on side a, decode and sglang-router on side b, `kvpipe launch`'s router flags:
launch/router.py ROUTER_RECOVERY_FLAGS), a partition of 8 s, longer than the PD heartbeat timeout
(2.5 s) and than the router's health checks need to mark the prefill unhealthy, then the heal. A
request sent after the heal is retried by the client (what a client does on 503) until one is
served; the test asserts it is served, exactly (the same tokens as before the partition), within a
generous liveness bound, and prints how long it took (docs/faults.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.harness.link_faults import FaultRun, LinkFault, nft_missing
from kvpipe.harness.testbed import LinkTestbed, can_run, inside_netns
from kvpipe.harness.testbed_stack import start_testbed_stack
from tests.helpers.heal import served_after
from tests.helpers.pd_stack import greedy

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not can_run(), reason="needs root and iproute2"),
    pytest.mark.skipif(nft_missing() is not None, reason=str(nft_missing())),
]

FLAGS = ["--page-size", "16", "--max-total-tokens", "8192", "--disaggregation-heartbeat-interval", "0.5"]
BODY = {"input_ids": list(range(5, 205)), "sampling_params": greedy(8)}
BOUND_S = 120.0  # liveness, not a timing assert


def test_router_serves_again_soon_after_a_heal(tmp_path: Path, tiny_model_dir: Path) -> None:
    with LinkTestbed("100mbit", state_dir=tmp_path) as tb, inside_netns(tb.ns_b):
        with start_testbed_stack(tb, str(tiny_model_dir), server_args=FLAGS, log_dir=str(tmp_path / "logs")) as stack:
            before, _, _ = served_after(stack.router_url, BODY, BOUND_S)
            with FaultRun(tb.spec, LinkFault.parse("partition:8s")) as run:
                assert run.wait_healed(60), "the partition did not heal"
            after, took_s, failed = served_after(stack.router_url, BODY, BOUND_S)
            print(f"served {took_s:.1f}s after the heal, {failed} tries failed first")
            assert after["output_ids"] == before["output_ids"]
