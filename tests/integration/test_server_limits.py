"""Issue 30's attacks on the HTTP API, against a real engine on the tiny model (in process: one
app, one model load, no server process): finding 4 (no caps: a million prompts, a million stop
strings, a prompt too long to tokenize, an unbounded queue) and finding 7 (no API key: anyone
could abort every request, also cross-site with a text/plain body). Each attack fails with a
clear 4xx (or 503 with Retry-After), and afterwards the server holds no request and every KV
page is free (kvpipe/qa/leaks.py, the check the soak and chaos runs use).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvpipe.config import CacheConfig, RequestLimits, SchedulerConfig, ServerConfig
from kvpipe.qa.checks import failed
from kvpipe.qa.leaks import pool_checks
from kvpipe.server.app_state import ServerState
from kvpipe.server.http_server import create_app

pytestmark = pytest.mark.timeout(300)

KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": "Bearer admin-key-0123456789abcdef"}  # abort_all is an admin's (issue 45)
MAX_RUNNING, MAX_QUEUED = 2, 2
# long enough that the attacks below land while these requests still run (a few HTTP calls
# against thousands of decode steps)
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[TestClient, ServerState]]:
    cfg = ServerConfig(
        model_path=str(tiny_model_dir),
        cache=CacheConfig(page_size=16, max_total_tokens=16384),
        scheduler=SchedulerConfig(context_length=4096, max_running_requests=MAX_RUNNING),
        limits=RequestLimits(max_queued_requests=MAX_QUEUED),  # the other caps at their defaults
        api_key=KEY,
        admin_api_key=ADMIN["Authorization"].split()[1],
        log_level="warning",
    )
    app = create_app(cfg)
    with TestClient(app, raise_server_exceptions=False, headers=AUTH) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "engine did not load"
            time.sleep(0.1)
        yield client, app.state.kvpipe


def _assert_back_to_idle(client: TestClient, state: ServerState, timeout_s: float = 60.0) -> None:
    """No request held by the server or its engine, every KV page free."""
    deadline, problems = time.monotonic() + timeout_s, ["not checked"]
    while time.monotonic() < deadline:
        stats = client.get("/server_info").json()["internal_states"][0]
        problems = failed(pool_checks("server", stats))
        if state.engine.num_active():
            problems.append(f"the server holds {state.engine.num_active()} requests")
        if not problems:
            return
        time.sleep(0.1)
    raise AssertionError(f"resources not back after the attack: {problems}")


class Background:
    """Long /generate requests posted from threads; `outs` gets each answer's JSON."""

    def __init__(self, client: TestClient, n: int) -> None:
        self.outs: list[Any] = []
        self.threads = [threading.Thread(target=self._post, args=(client, i)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _post(self, client: TestClient, i: int) -> None:
        r = client.post("/generate", json={"text": f"request {i}", "sampling_params": LONG})
        self.outs.append(r.json())

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=120)
            assert not t.is_alive()


def _wait_held(state: ServerState, n: int) -> None:
    deadline = time.monotonic() + 60
    while state.engine.num_active() < n:
        assert time.monotonic() < deadline, f"only {state.engine.num_active()} of {n} requests arrived"
        time.sleep(0.02)


def test_finding_4_caps_and_the_queue(served: tuple[TestClient, ServerState]) -> None:
    client, state = served
    _assert_back_to_idle(client, state)

    # one /generate body of a million prompts (4.8 MB): refused by counting, nothing submitted
    body = json.dumps({"text": ["a"] * 1_000_000, "sampling_params": {"max_new_tokens": 1}})
    r = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "--max-prompts-per-request" in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", json={"prompt": ["a"] * 100_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"

    # a million stop strings (0.29 s of engine time per token before), or one huge one
    for sampling, flag in (
        ({"stop": ["x"] * 1_000_000}, "--max-stop-strings"),
        ({"stop": "y" * 100_000}, "--max-stop-string-chars"),
        ({"stop_token_ids": [1] * 100_000}, "--max-stop-token-ids"),
    ):
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1, **sampling}})
        assert r.status_code == 400 and flag in r.json()["error"]["message"], r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stop": ["z"] * 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"

    # a prompt no context holds: refused by its characters, not tokenized first
    for path, body in (
        ("/generate", {"text": "word " * 1_000_000}),
        ("/v1/completions", {"prompt": "word " * 1_000_000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1_000_000}]}),
    ):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "characters: it cannot fit" in r.json()["error"]["message"], (path, r.text)

    # n, logprobs and top_logprobs are capped at what the engine computes
    for path, body in (
        ("/generate", {"text": "hi", "sampling_params": {"n": 10**9}}),
        ("/generate", {"text": "hi", "top_logprobs_num": 10**9}),
        ("/v1/completions", {"prompt": "hi", "n": 10**9}),
        ("/v1/completions", {"prompt": "hi", "logprobs": 10**9}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 10**9}),
    ):
        assert client.post(path, json=body).status_code == 400, (path, body)

    # the queue: running + queued requests fill the server; one more is a 503 with Retry-After
    held = Background(client, MAX_RUNNING + MAX_QUEUED)
    _wait_held(state, MAX_RUNNING + MAX_QUEUED)
    r = client.post("/generate", json={"text": "one too many", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "--max-queued-requests" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert state.engine.num_active() == MAX_RUNNING + MAX_QUEUED  # the refused ones took nothing
    r = client.post("/generate", json={"text": ["a"] * 5, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "holds at once" in r.json()["error"]["message"]  # never fits
    aborted = client.post("/abort_request", json={"abort_all": True}, headers=ADMIN).json()
    assert aborted == {"aborted": MAX_RUNNING + MAX_QUEUED}
    held.join()
    assert [o["meta_info"]["finish_reason"]["type"] for o in held.outs] == ["abort"] * (MAX_RUNNING + MAX_QUEUED)
    _assert_back_to_idle(client, state)
    # and it serves again
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
    _assert_back_to_idle(client, state)


def test_finding_7_api_key_and_cross_site_abort(served: tuple[TestClient, ServerState]) -> None:
    client, state = served
    _assert_back_to_idle(client, state)
    victims = Background(client, MAX_RUNNING)
    _wait_held(state, MAX_RUNNING)

    # anyone who reaches the port: no key, a wrong key
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer not-the-key-at-all"}):
        r = client.post("/abort_request", json={"abort_all": True}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), r.text
        assert client.post("/generate", json={"text": "free ride"}, headers=headers).status_code == 401
        assert client.get("/server_info", headers=headers).status_code == 401
    # a web page's cross-site POST: a simple request can only be text/plain (or a form), never
    # application/json, so even a browser that somehow carried the key gets a 415
    r = client.post("/abort_request", content=b'{"abort_all": true}', headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text
    # the probes stay open to a load balancer without the key
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200

    assert state.engine.num_active() == MAX_RUNNING  # nothing was aborted
    # the operator, with the admin key, can
    assert client.post("/abort_request", json={"abort_all": True}, headers=ADMIN).json() == {"aborted": MAX_RUNNING}
    victims.join()
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in victims.outs)
    _assert_back_to_idle(client, state)


def test_router_style_client_with_the_key_is_served(served: tuple[TestClient, ServerState]) -> None:
    """What sglang-router 0.3.2 with --api-key sends (probed: the bearer key on /server_info,
    /model_info and the request routes, none on /health)."""
    client, _ = served
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200
    for path in ("/server_info", "/model_info", "/get_server_info", "/get_model_info", "/v1/models"):
        assert client.get(path, headers=AUTH).status_code == 200, path
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
