"""Torch threads of served processes: `serve --cpu-threads` reaches torch and /server_info, and the
local PD stack (what `kvpipe launch` starts) gives prefill and decode limited, disjoint shares."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from kvpipe.engine.cpu_threads import affinity_cores
from kvpipe.launch import ports as launch_ports
from kvpipe.launch.core_split import split_cores
from kvpipe.launch.ports import free_ports
from kvpipe.launch.start import start_pd_stack
from tests.helpers.server import server_fixture

pytestmark = pytest.mark.timeout(120)


def _threads(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=30.0).json()["cpu_threads"]


def test_serve_reports_its_cpu_threads(tiny_model_dir: Path, tmp_path: Path) -> None:
    for srv in server_fixture(tiny_model_dir, tmp_path, "--cpu-threads", "1"):
        t = _threads(srv.url)
        assert (t["per_rank"], t["total"], t["source"], t["interop"]) == (1, 1, "flag", 1)
        assert t["torch"] == {"intra_op": 1, "interop": 1}  # applied in the process, not only planned
        assert t["omp_wait_policy"] == "PASSIVE"  # what its libgomp read (cpu_threads.prefer_passive_omp_wait)
        assert "cpu threads: 1 intra-op per TP rank" in srv.log()


def test_launch_splits_the_cores(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: ports taken by another process after they were picked (what once failed the soak and
    the xPyD tests on a busy machine) cost the stack a second start of the part that lost them,
    with fresh ports, not its start: here the decode's HTTP port and the router's port."""
    pytest.importorskip("mooncake.engine")
    split = split_cores(affinity_cores())
    with socket.socket() as taken_d, socket.socket() as taken_r:
        for s in (taken_d, taken_r):
            s.bind(("127.0.0.1", 0))
            s.listen()
        picks: list[list[int]] = []

        def pick_then_lose(n: int, host: str = "127.0.0.1") -> list[int]:
            ports = free_ports(n, host)
            if not picks:  # the stack's first pick: [prefill, decode, bootstrap, router, metrics]
                ports[1], ports[-2] = taken_d.getsockname()[1], taken_r.getsockname()[1]
            picks.append(ports)
            return ports

        monkeypatch.setattr(launch_ports, "free_ports", pick_then_lose)
        with start_pd_stack(str(tiny_model_dir), log_dir=str(tmp_path), timeout_s=90.0) as stack:
            # then the decode's fresh HTTP port, then the router's fresh pair
            assert [len(p) for p in picks] == [5, 1, 2]
            assert stack.decode_url == f"http://127.0.0.1:{picks[1][0]}" == stack.decode_urls[0]
            assert stack.router_url == f"http://127.0.0.1:{picks[2][0]}"
            assert httpx.get(stack.router_url + "/health", timeout=10.0).status_code == 200
            assert "address already in use" in (tmp_path / "decode.log").read_text().lower()
            assert stack.cores == split
            p, d = _threads(stack.prefill_url), _threads(stack.decode_url)
    assert (p["source"], d["source"]) == ("flag", "flag")
    assert p["torch"]["intra_op"] == p["per_rank"] == len(split.prefill)
    assert d["torch"]["intra_op"] == d["per_rank"] == len(split.decode)
    assert p["total"] + d["total"] <= max(2, len(affinity_cores()))  # never one thread per core each
    if split.disjoint:  # each server runs on its own share
        assert (p["affinity"], d["affinity"]) == (list(split.prefill), list(split.decode))
        assert not set(p["affinity"]) & set(d["affinity"])
