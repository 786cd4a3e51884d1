"""Bodies no schema fuzzer builds (they are not JSON a schema can describe) still get a 400,
never a 500; the engine is not needed to refuse them."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvpipe.config import ServerConfig
from kvpipe.server.async_engine import EngineLike
from kvpipe.server.http_server import create_app


def _never_loads() -> EngineLike:
    raise AssertionError("the engine is not needed to refuse a body")


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"])
@pytest.mark.parametrize(
    "body",
    [
        "[" * 100_000 + "]" * 100_000,  # was a 500: json.loads raised RecursionError
        '{"a":' * 50_000 + "1" + "}" * 50_000,
        "1e400",
        "NaN",
        "[]",
        '"\\ud800"',
        "\xff\xfe",
        "{",
        "",
    ],
    ids=["deep-list", "deep-map", "inf", "nan", "list", "lone-surrogate", "not-utf8", "truncated", "empty"],
)
def test_hostile_bodies_are_400(tmp_path, path: str, body: str) -> None:
    client = TestClient(create_app(ServerConfig(model_path=str(tmp_path)), _never_loads), raise_server_exceptions=False)
    r = client.post(path, content=body.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
