"""OpenAI routes when the server gives up on a request: the reason reaches the client as an error
(non-streamed: HTTP 500 with the message; streamed: an error event), where a 200 with
finish_reason "abort" would say nothing. Native /generate keeps its abort finish reason, which
carries the message."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.server.http_server import create_app

PROMPT = list(range(5, 55))  # 50 tokens: with 30 new ones 5 pages of 16; the KV cache holds 4


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    cfg = ServerConfig(
        model_path=str(tiny_model_dir),
        cache=CacheConfig(page_size=16, max_total_tokens=64),
        scheduler=SchedulerConfig(context_length=128),
        log_level="warning",
    )
    with TestClient(create_app(cfg)) as c:
        end = time.monotonic() + 120
        while c.get("/health").status_code != 200:
            assert time.monotonic() < end, "engine did not load"
            time.sleep(0.1)
        yield c


def test_a_request_the_server_gives_up_on_is_an_error_with_the_reason(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert "the KV cache holds only 4" in err["message"] and err["code"] == 500
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and "the KV cache holds only 4" in errors[0]["message"]
    native = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30}})
    assert native.status_code == 200
    fin = native.json()["meta_info"]["finish_reason"]
    assert fin["type"] == "abort" and "the KV cache holds only 4" in fin["message"]


def test_a_request_that_fits_is_served(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT[:20], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
