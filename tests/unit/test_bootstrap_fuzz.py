"""Property tests of the bootstrap server's HTTP API: any JSON body, any path, any method gets
an answer below 500, and a valid registration still works afterwards (a hostile or buggy peer
cannot break the registry for the real prefill ranks)."""

from __future__ import annotations

import copy
import json
import math
from typing import Any
from urllib.parse import quote

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.transfer.control.auth import HTTP_HEADER, REPLY_HEADER, Authenticator, http_context
from kvpipe.transfer.control.bootstrap import PrefillRankInfo, _app, _Registry
from kvpipe.transfer.planning.layout import KVLayout
from tests.helpers.wire_maps import key_paths

FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# JSON as Python's json module reads it: inf and nan included (1e400 parses as inf)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=15,
)

LAYOUT = KVLayout(
    num_layers=1,
    page_size=4,
    kv_heads=1,
    head_start=0,
    total_kv_heads=1,
    head_dim=8,
    dtype="float32",
    itemsize=4,
    buffer_addrs=(1 << 20, 2 << 20),
    buffer_nbytes=16 * 4 * 8 * 4,
)


def registration(instance: str = "inst-real") -> dict[str, Any]:
    return PrefillRankInfo(0, 1, LAYOUT, "127.0.0.1:17000", "tcp://127.0.0.1:18000", "m", instance).to_dict()


def _check_still_serves(client: TestClient) -> None:
    r = client.put("/v1/prefill/ranks/0", json=registration())
    assert r.status_code == 200, r.text
    got = client.get("/v1/prefill/ranks").json()
    assert got["instance_id"] == "inst-real" and got["ranks"] == [registration()]


def _put(client: TestClient, rank: Any, body: Any) -> int:
    # inf/nan go as Python's json writes them (Infinity, NaN), which the server's parser accepts
    raw = json.dumps(body, allow_nan=True)
    return client.put(
        f"/v1/prefill/ranks/{quote(str(rank), safe='')}", content=raw, headers={"content-type": "application/json"}
    ).status_code


def test_any_json_body_is_a_client_error() -> None:
    client = TestClient(_app(_Registry()))

    @FUZZ
    @given(st.integers(-5, 5) | st.integers() | st.text(max_size=10), JSON)
    def put_anything(rank: Any, body: Any) -> None:
        assert _put(client, rank, body) < 500

    put_anything()
    _check_still_serves(client)


def test_a_registration_with_one_field_broken_is_refused_cleanly() -> None:
    client = TestClient(_app(_Registry()))

    @FUZZ
    @given(st.data())
    def break_one(data: st.DataObject) -> None:
        body = copy.deepcopy(registration(f"inst-{data.draw(st.integers(0, 3))}"))
        path = data.draw(st.sampled_from(key_paths(body)))
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        if data.draw(st.booleans()):
            parent[path[-1]] = data.draw(JSON)
        else:
            del parent[path[-1]]
        assert _put(client, 0, body) < 500
        # what the server answers for the whole instance stays well-formed JSON, never a 500
        assert client.get("/v1/prefill/ranks").status_code in (200, 503)

    break_one()
    _check_still_serves(client)


def test_any_path_and_method_is_a_client_error() -> None:
    client = TestClient(_app(_Registry()))

    @FUZZ
    @given(
        st.sampled_from(["GET", "PUT", "POST", "DELETE", "PATCH"]),
        st.lists(st.text(min_size=1, max_size=12).map(lambda p: quote(p, safe="")), max_size=5),
        st.binary(max_size=64),
    )
    def request_anything(method: str, parts: list[str], body: bytes) -> None:
        r = client.request(method, "/" + "/".join(parts), content=body)
        assert r.status_code < 500

    request_anything()
    _check_still_serves(client)


def test_overflowing_numbers_are_malformed_not_a_crash() -> None:
    """Found by the properties above: 1e400 is JSON for inf, and int(inf) raised OverflowError,
    which escaped as a 500."""
    client = TestClient(_app(_Registry()))
    for path in (("rank",), ("tp_size",)):
        body = registration()
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = math.inf  # json.dumps writes Infinity, which the server reads as inf
        r = client.put("/v1/prefill/ranks/0", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 400 and "OverflowError" in r.json()["detail"], (path, r.text)
    body = registration()
    body["layout"]["buffer_addrs"] = [1e400, 0]
    assert _put(client, 0, body) == 400
    _check_still_serves(client)


def test_a_body_that_is_not_an_object_is_422_even_when_it_is_inf() -> None:
    """Found by the properties above: FastAPI's default 422 echoes the input, and inf is not JSON,
    so rendering the error raised and the answer was a 500."""
    client = TestClient(_app(_Registry()))
    for raw in ("Infinity", "[NaN]", '"x"', "1e400"):
        r = client.put("/v1/prefill/ranks/0", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 422 and "body" in r.json()["detail"], (raw, r.text)
    _check_still_serves(client)


def test_with_a_token_nothing_unsigned_gets_through() -> None:
    """An authenticated registry: any unsigned or badly signed call is a 4xx (401 for the routes),
    the registry is unchanged, and a signed registration still works."""
    token = "fuzzing-the-bootstrap-token"
    registry = _Registry()
    client = TestClient(_app(registry, Authenticator.from_token(token), instance="fuzz-instance"))
    signer = Authenticator.from_token(token)
    assert client.get("/health").json()["instance"] == "fuzz-instance"

    def ctx(method: str, path: str) -> bytes:
        return http_context(method, "testserver:80", path, "fuzz-instance")  # TestClient's scope["server"]

    def signed_put(body: dict[str, Any]) -> int:
        raw = json.dumps(body).encode()
        return client.put(
            "/v1/prefill/ranks/0",
            content=raw,
            headers={
                "content-type": "application/json",
                HTTP_HEADER: signer.sign_http(ctx("PUT", "/v1/prefill/ranks/0"), raw),
            },
        ).status_code

    assert signed_put(registration()) == 200

    @FUZZ
    @given(
        st.sampled_from([("GET", "/v1/prefill/ranks"), ("GET", "/v1/prefill/ranks/0"), ("PUT", "/v1/prefill/ranks/0")]),
        JSON,
        st.none() | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80),
    )
    def forge(route: tuple[str, str], body: Any, header: str | None) -> None:
        method, path = route
        headers = {"content-type": "application/json", **({HTTP_HEADER: header} if header is not None else {})}
        r = client.request(method, path, content=json.dumps(body, allow_nan=True), headers=headers)
        assert r.status_code == 401, (r.status_code, r.text)

    forge()
    assert registry.auth_rejected > 0
    assert signed_put(registration("inst-new")) == 200
    raw_get = signer.sign_http(ctx("GET", "/v1/prefill/ranks"), b"")
    resp = client.get("/v1/prefill/ranks", headers={HTTP_HEADER: raw_get})
    assert resp.json()["instance_id"] == "inst-new"
    signer.verify_reply(ctx("GET", "/v1/prefill/ranks"), raw_get, resp.content, resp.headers[REPLY_HEADER])
