"""ServerState: what routes read of the engine (503 while loading), the non-streamed answer
(499 when the client left, prefill failures, 409 for a refused PD handshake), the handshake
refusal metric, and the route modules' import direction
(state <- openai_api <- http_server, no cycle)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.responses import Response

from kvpipe.config import SchedulerConfig, ServerConfig
from kvpipe.engine.request import FinishReason
from kvpipe.server.app_state import ServerState
from kvpipe.server.async_engine import AsyncEngine
from kvpipe.server.errors import APIError
from kvpipe.server.metrics import ServerMetrics
from kvpipe.server.request_tracker import RequestOutput
from kvpipe.transfer.control.handshake import REFUSED


def _state(engine: object, cfg: ServerConfig, mode: str = "null") -> ServerState:
    return ServerState(cfg, engine, ServerMetrics(cfg.model_name, lambda: None), mode)  # type: ignore[arg-type]


def test_engine_properties_are_503_while_loading(tmp_path: Path) -> None:
    cfg = ServerConfig(model_path=str(tmp_path / "missing"), scheduler=SchedulerConfig(context_length=77))
    state = _state(AsyncEngine(lambda: None), cfg)  # never started: the engine is still loading
    for name in ("tokenizer", "model_config", "context_length", "eos_token_ids", "limits"):
        with pytest.raises(APIError) as e:
            getattr(state, name)
        assert e.value.status == 503 and "loading" in e.value.message
    assert state.advertised_context_length() == 77  # the flag, while the engine loads
    # not a local directory: hidden from sglang-router, and not kvpipe's checkpoint_path either
    assert state.model_paths() == {"model_path": None, "tokenizer_path": None, "checkpoint_path": None}


def test_engine_properties_once_loaded(tmp_path: Path) -> None:
    loaded = SimpleNamespace(
        tokenizer="tok", model_config=SimpleNamespace(vocab_size=300), context_length=512, eos_token_ids=(2, 7)
    )
    cfg = ServerConfig(model_path=str(tmp_path), scheduler=SchedulerConfig(context_length=77))
    state = _state(SimpleNamespace(engine=loaded, ready=True), cfg)
    assert (state.tokenizer, state.context_length, state.eos_token_ids) == ("tok", 512, (2, 7))
    assert (state.limits.vocab_size, state.limits.context_length) == (300, 512)
    assert state.advertised_context_length() == 512  # the engine's, once it is loaded
    assert state.model_paths() == {
        "model_path": str(tmp_path),
        "tokenizer_path": str(tmp_path),
        "checkpoint_path": str(tmp_path),
    }
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    state = _state(SimpleNamespace(engine=loaded, ready=True), ServerConfig(model_path=str(gguf)))
    # a GGUF file: only kvpipe's own key names it (sglang-router would try to download a file path)
    assert state.model_paths() == {"model_path": None, "tokenizer_path": None, "checkpoint_path": str(gguf)}


def test_openai_routes_do_not_import_the_native_server() -> None:
    code = (
        "import sys, kvpipe.server.openai_api; "
        "assert 'kvpipe.server.http_server' not in sys.modules, 'openai_api imports http_server'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def _output(rid: str, reason: FinishReason, detail: str | None = None) -> RequestOutput:
    return RequestOutput(
        rid=rid,
        index=0,
        text="t",
        delta_text="",
        output_ids=[1],
        num_new_ids=0,
        output_logprobs=[],
        prompt_tokens=2,
        cached_tokens=0,
        e2e_latency=0.0,
        finish_reason=reason,
        finish_detail=detail,
    )


class _Stream:
    """Stands in for a RequestStream: finishes with `out`, or never when out is None."""

    def __init__(self, out: RequestOutput | None) -> None:
        self.out, self.closed = out, False

    async def result(self) -> RequestOutput:
        if self.out is None:
            await asyncio.Event().wait()
        assert self.out is not None
        return self.out

    def close(self) -> None:
        self.closed = True


class _Request:
    """Stands in for a starlette Request whose body was read; `gone`: the client has left."""

    def __init__(self, gone: bool) -> None:
        self.gone = gone

    async def receive(self) -> dict:
        if not self.gone:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}


def _rids(outs: list[RequestOutput]) -> list[str]:
    return [o.rid for o in outs]


def _respond(state: ServerState, streams: list[_Stream], gone: bool = False) -> Response:
    return asyncio.run(state.respond_when_done(_Request(gone), streams, _rids))  # type: ignore[arg-type]


def test_respond_when_done_answers_all_outputs_in_order(tmp_path: Path) -> None:
    streams = [_Stream(_output("a", FinishReason.LENGTH)), _Stream(_output("b", FinishReason.STOP))]
    r = _respond(_state(None, ServerConfig(model_path=str(tmp_path))), streams)
    assert (r.status_code, json.loads(r.body)) == (200, ["a", "b"])
    assert all(s.closed for s in streams)


def test_respond_when_done_is_499_when_the_client_left(tmp_path: Path) -> None:
    streams = [_Stream(None), _Stream(_output("b", FinishReason.LENGTH))]
    r = _respond(_state(None, ServerConfig(model_path=str(tmp_path))), streams, gone=True)
    assert r.status_code == 499 and all(s.closed for s in streams)  # closing a stream aborts its request


def test_respond_when_done_fails_a_prefill_that_did_not_hand_its_kv_over(tmp_path: Path) -> None:
    cfg = ServerConfig(model_path=str(tmp_path))
    streams = [_Stream(_output("a", FinishReason.ABORT, "KV transfer failed"))]
    with pytest.raises(APIError) as e:
        _respond(_state(None, cfg, "prefill"), streams)
    assert e.value.status == 500 and "KV transfer failed" in e.value.message and streams[0].closed
    assert _respond(_state(None, cfg), [_Stream(_output("a", FinishReason.ABORT))]).status_code == 200


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_refused_handshake_is_a_native_abort_on_both_sides(tmp_path: Path, mode: str) -> None:
    """sglang-router 0.3.2 retries any error status: a refused PD handshake (which no retry can
    cure) answers /generate with SGLang's abort and its reason on the prefill too."""
    why = f"KV transfer failed: {REFUSED}: page size: prefill 16, decode 64"
    state = _state(None, ServerConfig(model_path=str(tmp_path)), mode)
    r = _respond(state, [_Stream(_output("a", FinishReason.ABORT, why))])
    assert r.status_code == 200


def test_refused_handshakes_are_counted_in_metrics_by_reason() -> None:
    stats = {"disaggregation": {"handshakes_refused": {"page_size": 2, "model": 1}}}
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'kvpipe_pd_handshakes_refused_total{reason="page_size"} 2.0' in text
    assert 'kvpipe_pd_handshakes_refused_total{reason="model"} 1.0' in text


def test_offload_runs_off_the_event_loop(tmp_path: Path) -> None:
    """Validation and tokenization go through `offload`: a prep thread, not the loop's."""
    state = _state(AsyncEngine(lambda: None), ServerConfig(model_path=str(tmp_path)))

    async def where() -> tuple[str, str]:
        return threading.current_thread().name, await state.offload(lambda: threading.current_thread().name)

    loop_thread, prep_thread = asyncio.run(where())
    assert prep_thread.startswith("kvpipe-prep") and prep_thread != loop_thread
    state.prep.shutdown()
