"""ServerState: what routes read of the engine (503 while loading), and the route modules'
import direction (state <- openai_api <- http_server, no cycle)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpipe.config import SchedulerConfig, ServerConfig
from kvpipe.server.async_engine import AsyncEngine
from kvpipe.server.errors import APIError
from kvpipe.server.metrics import ServerMetrics
from kvpipe.server.state import ServerState


def _state(engine: object, cfg: ServerConfig) -> ServerState:
    return ServerState(cfg, engine, ServerMetrics(cfg.model_name, lambda: None))  # type: ignore[arg-type]


def test_engine_properties_are_503_while_loading(tmp_path: Path) -> None:
    cfg = ServerConfig(model_path=str(tmp_path / "missing"), scheduler=SchedulerConfig(context_length=77))
    state = _state(AsyncEngine(lambda: None), cfg)  # never started: the engine is still loading
    for name in ("tokenizer", "model_config", "context_length", "eos_token_ids", "limits"):
        with pytest.raises(APIError) as e:
            getattr(state, name)
        assert e.value.status == 503 and "loading" in e.value.message
    assert state.advertised_context_length() == 77  # the flag, while the engine loads
    assert state.model_paths() == {"model_path": None, "tokenizer_path": None}  # not a local directory


def test_engine_properties_once_loaded(tmp_path: Path) -> None:
    loaded = SimpleNamespace(tokenizer="tok", model_config=SimpleNamespace(vocab_size=300), context_length=512,
                             eos_token_ids=(2, 7))
    cfg = ServerConfig(model_path=str(tmp_path), scheduler=SchedulerConfig(context_length=77))
    state = _state(SimpleNamespace(engine=loaded, ready=True), cfg)
    assert (state.tokenizer, state.context_length, state.eos_token_ids) == ("tok", 512, (2, 7))
    assert (state.limits.vocab_size, state.limits.context_length) == (300, 512)
    assert state.advertised_context_length() == 512  # the engine's, once it is loaded
    assert state.model_paths() == {"model_path": str(tmp_path), "tokenizer_path": str(tmp_path)}


def test_openai_routes_do_not_import_the_native_server() -> None:
    code = ("import sys, kvpipe.server.openai_api; "
            "assert 'kvpipe.server.http_server' not in sys.modules, 'openai_api imports http_server'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
