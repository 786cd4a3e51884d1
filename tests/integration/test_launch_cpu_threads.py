"""Torch threads of served processes: `serve --cpu-threads` reaches torch and /server_info, and the
local PD stack (what `kvpipe launch` starts) gives prefill and decode limited, disjoint shares."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvpipe.engine.cpu_threads import affinity_cores
from kvpipe.server.core_split import split_cores
from kvpipe.server.launcher import start_pd_stack
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


def test_launch_splits_the_cores(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine")
    split = split_cores(affinity_cores())
    with start_pd_stack(str(tiny_model_dir), log_dir=str(tmp_path), timeout_s=90.0) as stack:
        assert stack.cores == split
        p, d = _threads(stack.prefill_url), _threads(stack.decode_url)
    assert (p["source"], d["source"]) == ("flag", "flag")
    assert p["torch"]["intra_op"] == p["per_rank"] == len(split.prefill)
    assert d["torch"]["intra_op"] == d["per_rank"] == len(split.decode)
    assert p["total"] + d["total"] <= max(2, len(affinity_cores()))  # never one thread per core each
    if split.disjoint:  # each server runs on its own share
        assert (p["affinity"], d["affinity"]) == (list(split.prefill), list(split.decode))
        assert not set(p["affinity"]) & set(d["affinity"])
