"""--api-key (issue 30, finding 7) without an engine: every route but the probes answers 401
without the key or with a wrong one, in the API's error shape, before its body is read; JSON
bodies are accepted only as application/json (415), so a cross-site text/plain POST fails."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from kvpipe.commands.flags import add_http_api_args, add_server_args, server_config_from_args
from kvpipe.config import ServerConfig
from kvpipe.server.api_key import OPEN_PATHS, bearer_token, key_matches
from kvpipe.server.async_engine import EngineLike
from kvpipe.server.client_keys import API_KEY_ENV, client_headers
from kvpipe.server.http_server import create_app

KEY = "k-0123456789abcdef"
GOOD = {"Authorization": f"Bearer {KEY}"}
BODY_ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]


def _never_loads() -> EngineLike:
    raise AssertionError("the engine is not needed to refuse a request")


def _client(tmp_path: Path, api_key: str | None = KEY, admin: str | None = None) -> TestClient:
    # no `with`: the engine never starts (a request that passes the key meets 503 "loading")
    app = create_app(ServerConfig(model_path=str(tmp_path), api_key=api_key, admin_api_key=admin), _never_loads)
    return TestClient(app, raise_server_exceptions=False)


def _routes(client: TestClient) -> list[tuple[str, str]]:
    app = client.app
    return sorted(
        (method, route.path)
        for route in app.routes  # type: ignore[attr-defined]
        if isinstance(route, APIRoute) or route.path in ("/openapi.json",)
        for method in (route.methods or ()) - {"HEAD"}
    )


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-key-0123456"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}],
    ids=["none", "wrong", "no-scheme", "basic"],
)
def test_every_route_but_the_probes_needs_the_key(tmp_path: Path, headers: dict[str, str]) -> None:
    client = _client(tmp_path)
    routes = _routes(client)
    assert ("POST", "/abort_request") in routes and ("GET", "/openapi.json") in routes
    for method, path in routes:
        r = client.request(method, path, headers=headers, json={"abort_all": True} if method == "POST" else None)
        if path in OPEN_PATHS:
            assert r.status_code != 401, (method, path)
            continue
        assert r.status_code == 401, (method, path, r.text)
        err = r.json()["error"]
        assert err["code"] == 401 and err["type"] == "authentication_error" and "--api-key" in err["message"]
        assert r.headers["www-authenticate"].startswith("Bearer")


def test_the_right_key_passes(tmp_path: Path) -> None:
    admin = "admin-0123456789abcdef"
    client = _client(tmp_path, admin=admin)
    for key in (KEY, admin):
        for method, path in _routes(client):
            body = {"abort_all": key == admin} if method == "POST" else None
            r = client.request(method, path, headers={"Authorization": f"Bearer {key}"}, json=body)
            assert r.status_code not in (401, 403) or (key == KEY and path.startswith("/debug/")), (
                method,
                path,
                r.text,
            )
    # nothing runs, so abort_all aborts nothing: the admin route was reached
    lower = {"Authorization": f"bearer {admin}"}  # RFC 6750: the scheme is case-insensitive
    assert client.post("/abort_request", headers=lower, json={"abort_all": True}).json() == {"aborted": 0}


def test_abort_all_without_the_key_is_refused_before_the_body_is_read(tmp_path: Path) -> None:
    client = _client(tmp_path)
    # a body the server could not even parse: the 401 came first
    r = client.post("/abort_request", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_without_a_key_nothing_needs_one(tmp_path: Path) -> None:
    client = _client(tmp_path, api_key=None)
    assert client.post("/abort_request", json={"abort_all": True}).json() == {"aborted": 0}
    assert client.get("/debug/requests").status_code == 200  # an open server: everyone is an admin
    assert "securitySchemes" not in client.get("/openapi.json").json()["components"]


def test_the_schema_says_which_routes_need_the_key(tmp_path: Path) -> None:
    doc = _client(tmp_path).get("/openapi.json", headers=GOOD).json()
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert ("security" in op) == (path not in OPEN_PATHS), path
            assert ("401" in op["responses"]) == (path not in OPEN_PATHS), path


@pytest.mark.parametrize("path", BODY_ROUTES)
@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"],
)
def test_json_only_as_application_json(tmp_path: Path, path: str, content_type: str | None) -> None:
    """What a web page can send cross-site without a CORS preflight is refused (415), whatever
    the body holds; application/json (with parameters) is read."""
    client = _client(tmp_path, api_key=None)
    headers = {"content-type": content_type} if content_type else {}
    r = client.post(path, content=b'{"abort_all": true}', headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == 415 and "application/json" in r.json()["error"]["message"]
    ok = client.post(path, content=b"{", headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 400  # parsed (and refused as malformed JSON), not 415


def test_bearer_parsing_and_compare() -> None:
    assert bearer_token(None) is None and bearer_token("Bearer") is None and bearer_token("Bearer  ") is None
    assert bearer_token("Bearer abc") == "abc" and bearer_token("BEARER  abc ") == "abc"
    assert bearer_token("Token abc") is None
    assert key_matches(f"Bearer {KEY}", KEY)
    assert not key_matches(f"Bearer {KEY}x", KEY) and not key_matches(f"Bearer {KEY[:-1]}", KEY)
    assert not key_matches(None, KEY)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_args(p)
    add_http_api_args(p)
    return p.parse_args(argv)


def test_flags_and_environment(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    base = ["--model-path", str(tiny_model_dir)]
    cfg = server_config_from_args(_parse(base))
    assert cfg.api_key is None and cfg.limits.max_queued_requests == 1024
    cfg = server_config_from_args(
        _parse([*base, "--api-key", KEY, "--max-queued-requests", "3", "--max-stop-strings", "2"])
    )
    assert cfg.api_key == KEY and cfg.limits.max_queued_requests == 3 and cfg.limits.max_stop_strings == 2
    monkeypatch.setenv(API_KEY_ENV, "from-the-environment")
    assert server_config_from_args(_parse(base)).api_key == "from-the-environment"
    assert server_config_from_args(_parse([*base, "--api-key", KEY])).api_key == KEY  # the flag wins
    with pytest.raises(SystemExit, match="--max-prompts-per-request must be a positive integer"):
        server_config_from_args(_parse([*base, "--max-prompts-per-request", "0"]))


def test_our_clients_send_the_key_from_the_environment() -> None:
    assert client_headers({API_KEY_ENV: "k"}) == {"Authorization": "Bearer k"}
    assert client_headers({}) == {} == client_headers({API_KEY_ENV: ""})
    assert key_matches(client_headers({API_KEY_ENV: "k"})["Authorization"], "k")
