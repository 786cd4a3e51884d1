"""Torch threads of served processes: `serve --cpu-threads` reaches torch and /server_info, and the
local PD stack (what `kvpipe launch` starts) gives prefill and decode limited, disjoint shares."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from kvpipe.engine.cpu_threads import affinity_cores
from kvpipe.server import launcher
from kvpipe.server.core_split import split_cores
from kvpipe.server.launcher import free_ports, start_pd_stack
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
    """Also: a router port taken by another process after it was picked (what once failed the soak
    test on a busy machine) costs the stack a second router start, not its start."""
    pytest.importorskip("mooncake.engine")
    split = split_cores(affinity_cores())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        picks: list[list[int]] = []

        def pick_then_lose(n: int, host: str = "127.0.0.1") -> list[int]:
            ports = free_ports(n, host)
            if not picks:  # the stack's first pick: the router's port (second to last) is taken
                ports[-2] = taken_port
            picks.append(ports)
            return ports

        monkeypatch.setattr(launcher, "free_ports", pick_then_lose)
        with start_pd_stack(str(tiny_model_dir), log_dir=str(tmp_path), timeout_s=90.0) as stack:
            assert len(picks) == 2 and stack.router_url == f"http://127.0.0.1:{picks[1][0]}"
            assert httpx.get(stack.router_url + "/health", timeout=10.0).status_code == 200
            assert stack.cores == split
            p, d = _threads(stack.prefill_url), _threads(stack.decode_url)
    assert (p["source"], d["source"]) == ("flag", "flag")
    assert p["torch"]["intra_op"] == p["per_rank"] == len(split.prefill)
    assert d["torch"]["intra_op"] == d["per_rank"] == len(split.decode)
    assert p["total"] + d["total"] <= max(2, len(affinity_cores()))  # never one thread per core each
    if split.disjoint:  # each server runs on its own share
        assert (p["affinity"], d["affinity"]) == (list(split.prefill), list(split.decode))
        assert not set(p["affinity"]) & set(d["affinity"])
