"""Request body limits: 413 with each app's own error shape, by Content-Length and by counting
a chunked body, before the route holds the whole body."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException

from kvpipe.body_limit import BodyLimitMiddleware
from kvpipe.cli import build_parser
from kvpipe.commands.flags import server_config_from_args
from kvpipe.config import ConfigError, ServerConfig
from kvpipe.server.async_engine import EngineLike
from kvpipe.server.http_server import create_app
from kvpipe.transfer.control.bootstrap import MAX_BODY_BYTES, _app, _Registry

LIMIT = 1000


def _chunks(total: int, size: int = 100) -> Iterator[bytes]:
    """A body without Content-Length (httpx sends a generator chunked)."""
    for i in range(0, total, size):
        yield b"x" * min(size, total - i)


def _echo_app(seen: list[int]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodyLimitMiddleware, max_bytes=LIMIT, knob="--the-flag")

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
            seen.append(n)  # how much of the body the route ever got
        return {"n": n}

    return app


def test_declared_length_over_the_limit_is_refused_before_any_byte_reaches_the_route() -> None:
    seen: list[int] = []
    client = TestClient(_echo_app(seen))
    r = client.post("/echo", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413
    assert r.json()["detail"] == (
        f"the request body of {LIMIT + 1} bytes exceeds the limit of {LIMIT} bytes (raise it with --the-flag)"
    )
    assert seen == []


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit() -> None:
    seen: list[int] = []
    client = TestClient(_echo_app(seen))
    r = client.post("/echo", content=_chunks(10 * LIMIT))
    assert r.status_code == 413 and f"limit of {LIMIT} bytes" in r.json()["detail"]
    assert max(seen, default=0) <= LIMIT  # the route never saw more than the limit


def test_the_limit_counts_body_messages_as_they_arrive() -> None:
    """Driven at the ASGI level, where a chunked upload is many small messages: the app gets
    the messages up to the limit, then an error instead of the next one; the rest is never read."""
    pulled = 0
    got: list[int] = []

    async def receive() -> dict:
        nonlocal pulled
        pulled += 1
        assert pulled <= 10, "the middleware kept reading past its limit"  # bounds the loop below
        return {"type": "http.request", "body": b"x" * 300, "more_body": True}

    async def inner(scope: dict, receive, send) -> None:
        while True:
            got.append(len((await receive())["body"]))

    async def send(message: dict) -> None:
        raise AssertionError("the middleware itself never answers")

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    with pytest.raises(HTTPException) as exc:
        asyncio.run(BodyLimitMiddleware(inner, max_bytes=LIMIT)(scope, receive, send))
    assert exc.value.status_code == 413 and "request body exceeds the limit" in exc.value.detail
    assert got == [300, 300, 300] and pulled == 4  # the 4th message (1200 bytes in all) was refused


def test_bodies_up_to_the_limit_pass() -> None:
    client = TestClient(_echo_app([]))
    assert client.post("/echo", content=b"x" * LIMIT).json() == {"n": LIMIT}
    assert client.post("/echo", content=_chunks(LIMIT)).json() == {"n": LIMIT}


def _never_loads() -> EngineLike:
    raise AssertionError("the engine is not needed to refuse a body")


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"])
def test_server_answers_413_in_the_openai_error_shape(tmp_path, path: str) -> None:
    cfg = ServerConfig(model_path=str(tmp_path), max_request_body_bytes=LIMIT)
    client = TestClient(create_app(cfg, _never_loads))  # no `with`: the engine never starts
    for body in (b'{"text": "' + b"a" * LIMIT + b'"}', _chunks(2 * LIMIT)):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == 413 and err["type"] == "invalid_request_error"
        assert "--max-request-body-bytes" in err["message"] and f"limit of {LIMIT} bytes" in err["message"]


def test_server_config_refuses_a_nonsense_limit(tmp_path) -> None:
    assert ServerConfig(model_path=str(tmp_path)).max_request_body_bytes == 32 << 20
    with pytest.raises(ConfigError, match="request body limit"):
        ServerConfig(model_path=str(tmp_path), max_request_body_bytes=0)


def test_bootstrap_server_caps_registrations_at_one_mib() -> None:
    assert MAX_BODY_BYTES == 1 << 20
    client = TestClient(_app(_Registry(), max_body_bytes=LIMIT))
    r = client.put(
        "/v1/prefill/ranks/0",
        content=b'{"rank": "' + b"0" * LIMIT + b'"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and f"limit of {LIMIT} bytes" in r.json()["detail"]
    r = client.put("/v1/prefill/ranks/0", content=_chunks(2 * LIMIT), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.get("/health").json()["status"] == "ok"


def test_serve_flag_sets_the_limit(tmp_path) -> None:
    parser, _ = build_parser(["serve"])
    args = parser.parse_args(["serve", "--model-path", str(tmp_path), "--max-request-body-bytes", "4096"])
    assert server_config_from_args(args).max_request_body_bytes == 4096
    with pytest.raises(SystemExit, match="--max-request-body-bytes must be a positive integer"):
        server_config_from_args(
            parser.parse_args(["serve", "--model-path", str(tmp_path), "--max-request-body-bytes", "0"])
        )
