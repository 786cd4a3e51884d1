"""A server started with --api-key behind the real sglang-router given the same --api-key: the
router reaches the server (it sends the bearer key on every call but its health checks) and asks
its own clients for the key. The router runs in its regular mode in front of one colocated
server (the PD router sends the same header to both workers; `kvpipe launch` gives its router
the key and a control-plane admin key: tests/integration/test_launch_secure.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpipe.launch.ports import free_ports
from kvpipe.launch.process import stop_process
from kvpipe.qa.checks import failed
from kvpipe.qa.leaks import pool_checks
from tests.helpers.server import ServerProc, start_server

pytestmark = pytest.mark.timeout(300)

KEY = "router-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("keyed") / "server.log", "--api-key", KEY)
    try:
        yield srv
    finally:
        stop_process(srv.proc)


def test_router_with_the_key_reaches_a_keyed_server(keyed_server: ServerProc, tmp_path: Path) -> None:
    assert keyed_server.post("/generate", json={"text": "hi"}).status_code == 401  # the key is on
    port, metrics_port = free_ports(2)
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115 - closed below
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            keyed_server.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            "warn",
            "--api-key",
            KEY,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
    try:
        deadline, r = time.monotonic() + 120, None
        while time.monotonic() < deadline:  # until the router has registered the worker
            assert router.poll() is None, (tmp_path / "router.log").read_text(errors="replace")
            try:
                r = httpx.post(url + "/generate", json=body, headers=AUTH, timeout=30)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert r is not None and r.status_code == 200, (r and r.text, (tmp_path / "router.log").read_text())
        assert r.json()["meta_info"]["completion_tokens"] == 4
        # the router asks its own clients for the key too
        assert httpx.post(url + "/generate", json=body, timeout=30).status_code == 401
    finally:
        stop_process(router)
        log.close()
    deadline, problems = time.monotonic() + 30, ["not checked"]
    while problems and time.monotonic() < deadline:  # the routed requests left nothing behind
        stats = keyed_server.get("/server_info", headers=AUTH).json()["internal_states"][0]
        problems = failed(pool_checks("server", stats))
        time.sleep(0.1)
    assert not problems, problems
