"""A decode the prefill declared dead gets fresh connections when it speaks again (issue 50,
transfer/sender/revivals.py). A PD stack across the testbed's link (tiny preset, prefill on side a,
decode and sglang-router on side b), heartbeat timeout 2.5 s, a partition of 8 s: both sides declare
the other dead. Through the partition our control connection to the decode kept resending its
heartbeats with a doubling timer; after the heal it would carry the answer to the decode's new
registration seconds late (docs/faults.md: ~14 s after a 15 s partition). The test asserts what the
fix does, not how fast: the prefill says it gave the decode fresh connections, the prefill's
connection to the decode's control port after the heal is a new one (not one from before the
partition), and the request served after the heal gives the same tokens as before it.

Readiness on the way (`/health?peers=true`): both servers ready before any request (no peer known
yet), each not ready with its reason during the partition (plain /health stays 200), and both ready
again after the heal without any request (the decode looks for its lost prefill: receiver/lost.py)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvpipe.harness.link_faults import FaultRun, LinkFault, nft_missing
from kvpipe.harness.testbed import LinkTestbed, can_run, inside_netns, tool
from kvpipe.harness.testbed_stack import start_testbed_stack
from tests.helpers.heal import served_after
from tests.helpers.pd_stack import greedy, wait_for

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not can_run(), reason="needs root and iproute2"),
    pytest.mark.skipif(nft_missing() is not None, reason=str(nft_missing())),
]

FLAGS = ["--page-size", "16", "--max-total-tokens", "8192", "--disaggregation-heartbeat-interval", "0.5"]
BODY = {"input_ids": list(range(7, 263)), "sampling_params": greedy(6)}
BOUND_S = 120.0  # liveness, not a timing assert
REVIVED = re.compile(r"decode at tcp://[\d.]+:(\d+) speaks again after it was declared dead: fresh connections")


def peers_ready(url: str) -> tuple[int, dict]:
    """(status, body) of a server's /health?peers=true."""
    r = httpx.get(url + "/health", params={"peers": "true"}, timeout=10.0)
    return r.status_code, (r.json() if r.content else {})


def connections(ns: str, peer: str) -> set[tuple[int, int]]:
    """(local port, peer port) of the established TCP connections from namespace `ns` to host `peer`."""
    out = subprocess.run(
        [tool("ip"), "netns", "exec", ns, "ss", "-tnH", "state", "established", "dst", peer],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    pairs = set()
    for line in out.splitlines():
        local, remote = line.split()[-2:]
        pairs.add((int(local.rsplit(":", 1)[1]), int(remote.rsplit(":", 1)[1])))
    return pairs


def test_a_decode_declared_dead_gets_a_fresh_control_connection_after_the_heal(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    logs = tmp_path / "logs"
    with LinkTestbed("100mbit", state_dir=tmp_path) as tb, inside_netns(tb.ns_b):
        with start_testbed_stack(tb, str(tiny_model_dir), server_args=FLAGS, log_dir=str(logs)) as stack:
            p_url, d_url = stack.prefill_url, stack.decode_url
            # no peer known yet: ready (a fresh stack does not flap)
            assert peers_ready(d_url)[0] == 200 and peers_ready(p_url)[0] == 200
            before, _, _ = served_after(stack.router_url, BODY, BOUND_S)
            assert peers_ready(d_url)[0] == 200 and peers_ready(p_url)[0] == 200
            old = connections(tb.ns_a, tb.addr_b)  # the prefill's control connection to the decode among them
            with FaultRun(tb.spec, LinkFault.parse("partition:8s")) as run:
                # the decode (this side) reports its lost prefill with a reason; plain /health stays 200
                status, body = wait_for(lambda: (s := peers_ready(d_url))[0] == 503 and s, BOUND_S, "decode not ready")
                assert body["status"] == "peers_unreachable" and "no reachable prefill" in body["reason"]
                assert httpx.get(d_url + "/health", timeout=10.0).status_code == 200
                prefill_down = lambda: (s := tb.call_in("a", peers_ready, p_url))[0] == 503 and s  # noqa: E731
                status, body = wait_for(prefill_down, BOUND_S, "prefill not ready")
                assert body["status"] == "peers_unreachable" and "no reachable decode" in body["reason"]
                assert run.wait_healed(60), "the partition did not heal"
            # back without any request: the decode looks for its lost prefill and registers again
            wait_for(lambda: peers_ready(d_url)[0] == 200 and peers_ready(p_url)[0] == 200, BOUND_S, "both ready again")
            assert run.healed_at is not None
            print(f"both ready again {time.monotonic() - run.healed_at:.1f}s after the heal (at most this)")
            after, took_s, failed = served_after(stack.router_url, BODY, BOUND_S)
            print(f"served {took_s:.1f}s after both were ready again, {failed} tries failed first")
            assert after["output_ids"] == before["output_ids"]
            text = (logs / "prefill.log").read_text()
            assert "decode at tcp://" in text and "sent nothing for" in text, "the partition declared no decode dead"
            ports = {int(p) for p in REVIVED.findall(text)}
            assert len(ports) == 1, "the prefill gave the decode no fresh connections when it spoke again"
            control = [c for c in connections(tb.ns_a, tb.addr_b) if c[1] in ports]
            assert control and not set(control) & old, (control, old)  # a new connection, not the old one
