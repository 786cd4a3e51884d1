"""Start a real `kvpipe serve` subprocess on a free loopback port for integration tests."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpipe.launch.ports import free_port
from kvpipe.launch.process import stop_process, wait_healthy


@dataclass
class ServerProc:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str, **kw: object) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30.0, **kw)  # type: ignore[arg-type]

    def post(self, path: str, **kw: object) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60.0, **kw)  # type: ignore[arg-type]

    def engine_stats(self) -> dict:
        return self.get("/server_info").json()["internal_states"][0]

    def metric(self, name: str, labels: str = "") -> float:
        """Value of one sample in /metrics (0 when absent), e.g. metric("kvpipe_requests_total",
        'finish_reason="abort"')."""
        text = self.get("/metrics").text
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if m and m.group(1) == name and labels in (m.group(2) or ""):
                return float(m.group(3))
        return 0.0

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Poll until no request runs or waits and every page is free; returns the stats."""
        deadline = time.monotonic() + timeout_s
        stats: dict = {}
        while time.monotonic() < deadline:
            stats = self.engine_stats()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["free_pages"] == stats["total_pages"]:
                return stats
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout_s}s: {stats}")


def start_server(model_dir: Path, log_path: Path, *extra: str, timeout_s: float = 120.0) -> ServerProc:
    port = free_port()
    out = open(log_path, "wb")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpipe.cli",
            "serve",
            "--model-path",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    srv = ServerProc(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_healthy(srv.url + "/health", timeout_s, [proc])
    except BaseException as e:
        stop_process(proc)
        raise RuntimeError(f"server did not start; log:\n{srv.log()[-4000:]}") from e
    return srv


def server_fixture(model_dir: Path, tmp_dir: Path, *extra: str, timeout_s: float = 120.0) -> Iterator[ServerProc]:
    srv = start_server(model_dir, tmp_dir / "server.log", *extra, timeout_s=timeout_s)
    try:
        yield srv
    finally:
        stop_process(srv.proc)
        assert srv.proc.returncode is not None


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    """Parse `data: ...` SSE lines; yields dicts, and the string "[DONE]" at the end."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        yield payload if payload == "[DONE]" else json.loads(payload)
