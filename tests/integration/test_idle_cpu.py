"""An idle PD stack takes (almost) no CPU: after serving a request, prefill, decode and
sglang-router each use little CPU time over a few seconds of waiting. `bench serve
--compare-colocated --interleave` runs the colocated server while the PD stack waits; a waiting
server that spun (a busy-polling engine loop or transfer thread) would slow it. Nothing is timed:
the bound is on CPU-seconds used, generous against the ~0.02 CPU-s per second measured on the
real model (docs/benchmarks.md) and far below a spinning thread's 1 CPU-s per second."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpipe.bench.serve.proc_cpu import cpu_seconds
from tests.helpers.pd_stack import generate, greedy, start_stack

pytestmark = pytest.mark.timeout(240)

IDLE_S = 3.0  # how long the stack waits while we read its CPU time
IDLE_BUDGET_CPU_S = 0.3  # per process over IDLE_S: 10% of a core (measured: 1-2%)


def test_idle_pd_stack_uses_little_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine")
    stack = start_stack(tiny_model_dir, tmp_path)
    try:
        out = generate(stack.router, {"input_ids": list(range(1, 40)), "sampling_params": greedy(4)})
        assert out["meta_info"]["completion_tokens"] == 4  # the transfer path ran, its threads are up
        stack.prefill.wait_idle()
        stack.decode.wait_idle()
        pids = {name: stack.pd.proc(name).pid for name in ("prefill", "decode", "router")}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        time.sleep(IDLE_S)
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        assert all(stack.pd.proc(name).poll() is None for name in pids), stack.logs()
    finally:
        stack.close()
    assert all(0 <= u <= IDLE_BUDGET_CPU_S for u in used.values()), used
