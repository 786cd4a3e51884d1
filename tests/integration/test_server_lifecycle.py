"""Server lifecycle: 503 while the engine loads, 200 after; a model that cannot load ends the process."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvpipe.config import CacheConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.launch.ports import free_port
from kvpipe.server.http_server import create_app

pytestmark = pytest.mark.timeout(300)


def _wait(pred, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_health_is_503_until_the_engine_is_loaded(tiny_model_dir: Path) -> None:
    cfg = ServerConfig(
        model_path=str(tiny_model_dir), port=free_port(), cache=CacheConfig(page_size=16, max_total_tokens=4096)
    )
    gate = threading.Event()
    loaded = threading.Event()

    def factory() -> Engine:
        assert gate.wait(60), "test never opened the gate"
        engine = Engine(cfg)
        loaded.set()
        return engine

    server = uvicorn.Server(uvicorn.Config(create_app(cfg, factory), host=cfg.host, port=cfg.port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    url = f"http://{cfg.host}:{cfg.port}"
    try:
        _wait(lambda: server.started, what="uvicorn start")
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        info = httpx.get(url + "/server_info").json()
        assert info["status"] == "loading" and info["context_length"] == 8192  # read from config.json
        g = httpx.post(url + "/generate", json={"text": "hi"})
        assert g.status_code == 503 and "loading" in g.json()["error"]["message"]
        gate.set()
        _wait(lambda: httpx.get(url + "/health").status_code == 200, what="health 200")
        assert loaded.is_set()
        out = httpx.post(
            url + "/generate",
            json={"text": "hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
            timeout=60,
        )
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] >= 1
    finally:
        gate.set()
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


def test_unloadable_model_exits_nonzero(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    proc = subprocess.run(
        [sys.executable, "-m", "kvpipe.cli", "serve", "--model-path", str(tmp_path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "unsupported architecture" in proc.stderr
