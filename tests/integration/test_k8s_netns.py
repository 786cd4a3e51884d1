"""The 2P2D overlay of deploy/k8s run as its pods would run (tests/helpers/k8s_netns.py): four
servers and the router, each in a network namespace of its own with its own address, joined by a
bridge; sglang-router with the manifests' --service-discovery flags (its pod watch answered by the
test). Greedy output through the router equals a colocated engine's (tokens and logprobs), the KV
crossed namespace addresses (the decodes' data planes are their pod IPs, the prefills wrote bytes,
TCP connections join prefill and decode namespaces on the Mooncake ports), and every pod's
/metrics answers at the address its Prometheus annotations name. The tiny preset here; the
default model (SmolLM2-135M) in the `slow` variant."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvpipe.config import CacheConfig, PortRange
from kvpipe.harness.testbed import can_run
from kvpipe.model.checkpoint.default_model import default_model_path
from tests.helpers.k8s_manifests import kubectl
from tests.helpers.k8s_netns import ManifestRun
from tests.helpers.pd_parity import colocated_reference, prompts
from tests.helpers.tolerance import Generation, Route, assert_same_generations

pytest.importorskip("mooncake.engine")
pytest.importorskip("sglang_router")
if not can_run() or kubectl() is None:
    pytest.skip("needs root with iproute2 (network namespaces) and kubectl", allow_module_level=True)
pytestmark = pytest.mark.timeout(900)

LENGTHS = [7, 40, 19, 64, 33, 12, 90, 25]
NEW = 8
MOONCAKE = re.compile(r"--disaggregation-mooncake-ports=(\d+)-(\d+)")


def build_cache_env() -> dict[str, str]:
    """The CPU kernels' build directory of this machine, where the caller set one."""
    return {k: os.environ[k] for k in ("KVPIPE_KERNEL_DIR",) if k in os.environ}


def generate(url: str, ids: list[int], headers: dict[str, str]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json={**body, "return_logprob": True}, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _v4(conn: tuple[str, ...]) -> tuple[str, ...]:
    """`ss` shows Mooncake's dual-stack sockets as [::ffff:10.98.0.1]: the IPv4 address."""
    return tuple(re.sub(r"^\[(?:::ffff:)?(.*)\]$", r"\1", x) for x in conn)


def check_run(run: ManifestRun, ids: list[list[int]], expected: list[Generation]) -> None:
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: run.call(generate, run.router_url, p, run.auth), ids))
    got = [Generation.of(r) for r in results]
    assert_same_generations(got, expected, Route.ACROSS_PROCESSES, ids, "the 2P2D overlay across namespaces")

    # the KV crossed namespace addresses: each server's planes are its pod IP, none loopback
    written = 0
    for pod in [*run.of_role("prefill"), *run.of_role("decode")]:
        url = f"http://{run.ip(pod)}:{pod.port('http')}/server_info"
        info = run.call(httpx.get, url, headers=run.admin, timeout=30).json()
        pd = info["internal_states"][0]["disaggregation"]
        assert pd["data_address"].startswith(run.ip(pod) + ":"), (pod.name, pd["data_address"])
        assert run.ip(pod) in pd["control_address"], (pod.name, pd["control_address"])
        written += pd.get("bytes_written") or 0
    assert written > 0
    prefill_ips = {run.ip(p) for p in run.of_role("prefill")}
    crossing: list[tuple[str, ...]] = []  # the router may send every request to one decode
    seen: dict[str, list[tuple[str, ...]]] = {}
    for pod in run.of_role("decode"):
        m = MOONCAKE.search(" ".join(pod.container["args"]))
        assert m is not None
        mooncake = PortRange(int(m.group(1)), int(m.group(2)))
        peers = re.findall(r"ESTAB\s+\d+\s+\d+\s+(\S+):(\d+)\s+(\S+):(\d+)", run.cluster.sockets(pod.name))
        seen[pod.name] = peers
        crossing += [
            (local, lport, peer)
            for local, lport, peer, _ in map(_v4, peers)
            if local == run.ip(pod) and peer in prefill_ips and mooncake.first <= int(lport) <= mooncake.last
        ]
    assert crossing, f"no Mooncake connection from a prefill namespace into a decode's: {seen}"

    # /metrics of every pod at the address its annotations name
    for pod in run.pods:
        a = pod.annotations
        assert a["prometheus.io/scrape"] == "true"
        url = f"http://{run.ip(pod)}:{a['prometheus.io/port']}{a['prometheus.io/path']}"
        r = run.call(httpx.get, url, timeout=30)
        assert r.status_code == 200 and "# TYPE" in r.text, (pod.name, url, r.status_code)


def test_2p2d_overlay_across_namespaces(tiny_model_dir: Path, tmp_path: Path) -> None:
    ids = prompts(LENGTHS, seed=13)
    expected = colocated_reference(tiny_model_dir, ids, NEW, CacheConfig().page_size)
    with ManifestRun.start(
        "2p2d", tmp_path, server_args=["--model-path", str(tiny_model_dir)], env=build_cache_env()
    ) as run:
        check_run(run, ids, expected)
        assert any("watch=true" in q for q in run.api.requests if run.api is not None)


@pytest.mark.slow
def test_2p2d_overlay_across_namespaces_default_model(tmp_path: Path) -> None:
    model = default_model_path()
    ids = prompts(LENGTHS[:4], vocab=40000, seed=13)
    expected = colocated_reference(model, ids, NEW, CacheConfig().page_size)
    # four servers on one machine: a smaller KV pool each than the manifests' default (3 GB at 65,536 tokens)
    small_pool = ["--max-total-tokens", "8192"]
    with ManifestRun.start("2p2d", tmp_path, server_args=small_pool, env=build_cache_env(), timeout_s=600.0) as run:
        check_run(run, ids, expected)
