"""A server's start says what matters (issue 47): its "ready" line comes after the model loaded,
and neither uvicorn's early "Uvicorn running on" nor Mooncake's start-up lines ("No RDMA devices
found", "Local segment descriptor not found") reach the log without --log-level debug."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpipe.launch.ports import free_port
from kvpipe.launch.process import stop_process
from tests.helpers.server import start_server

pytestmark = pytest.mark.timeout(240)

MOONCAKE_NOISE = ("No RDMA devices found", "Local segment descriptor not found", "Logging before InitGoogleLogging")
START_ENGINE = (
    "from kvpipe.transfer.backends.mooncake import MooncakeBackend\n"
    "b = MooncakeBackend('127.0.0.1')\n"
    "print('address', b.address, flush=True)\n"
    "b.close()\n"
)


def _start_engine(mc_log_level: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MC_LOG_LEVEL": mc_log_level}
    out = subprocess.run([sys.executable, "-c", START_ENGINE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "address 127.0.0.1:" in out.stdout, out.stderr[-2000:]
    return out


def test_mooncake_start_is_quiet_unless_asked() -> None:
    assert not [n for n in MOONCAKE_NOISE if n in _start_engine("ERROR").stderr]
    loud = _start_engine("INFO").stderr  # what --log-level debug shows: the lines exist to be hidden
    assert all(n in loud for n in MOONCAKE_NOISE), loud[-2000:]


def test_prefill_server_says_ready_after_the_model_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    flags = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(free_port()))
    srv = start_server(tiny_model_dir, tmp_path / "prefill.log", *flags)
    try:
        deadline = time.monotonic() + 30
        while "ready: " not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = srv.log()
    finally:
        stop_process(srv.proc)
    lines = log.splitlines()
    ready = [i for i, line in enumerate(lines) if f"ready: {tiny_model_dir.name} (prefill) at {srv.url}" in line]
    loaded = [i for i, line in enumerate(lines) if "loaded " in line and "tensors" in line]
    assert len(ready) == 1 and loaded and loaded[0] < ready[0], log[-3000:]
    assert "Uvicorn running" not in log and "Application startup" not in log
    assert not [n for n in MOONCAKE_NOISE if n in log], log[-3000:]
