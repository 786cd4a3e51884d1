"""What a running server says about its speed (issue 47): the speed lines in its log, speculation
settings and statistics and the KV dtype in /server_info, per-request speculation statistics in an
OpenAI answer with SGLang's `return_meta_info`, the generated-token counter and the worker name in
/metrics. One colocated server on the tiny preset with NGRAM speculation."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.server import ServerProc, server_fixture

pytestmark = pytest.mark.timeout(300)

FLAGS = (
    "--speculative-algorithm",
    "NGRAM",
    "--speculative-num-draft-tokens",
    "5",
    "--decode-log-interval",
    "4",
    "--worker-name",
    "decode7",
)
REPEATING = "one two three four " * 12  # the request's own n-grams draft its greedy continuation


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerProc]:
    yield from server_fixture(tiny_model_dir, tmp_path_factory.mktemp("speed"), *FLAGS)


def chat(server: ServerProc, **extra: object) -> dict:
    body = {"messages": [{"role": "user", "content": REPEATING}], "max_tokens": 40, "temperature": 0, **extra}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_return_meta_info_carries_speculation_statistics(server: ServerProc) -> None:
    plain = chat(server)["choices"][0]
    assert "meta_info" not in plain  # opt-in, as in SGLang
    choice = chat(server, return_meta_info=True)["choices"][0]
    meta = choice["meta_info"]
    assert meta["completion_tokens"] == 40 and meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] >= 1.0 and meta["spec_draft_token_num"] >= meta["spec_accept_token_num"]
    streamed = server.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "return_meta_info": True},
    )
    assert streamed.status_code == 400 and "return_meta_info" in streamed.text


def test_server_info_has_speculation_and_kv_dtype(server: ServerProc) -> None:
    chat(server)
    info = server.get("/server_info").json()
    assert info["speculative_algorithm"] == "NGRAM" and info["speculative_num_draft_tokens"] == 5
    assert info["speculative_num_steps"] == 4 and info["speculative_eagle_topk"] == 1
    assert info["kv_cache_dtype"] == "auto" and info["worker_name"] == "decode7"
    state = info["internal_states"][0]
    assert state["kv_cache_storage_dtype"] == "float32"  # auto on CPU: the model's float32
    assert state["avg_spec_accept_length"] >= 1.0 and state["generated_tokens"] >= 40


def test_speed_lines_and_generated_tokens(server: ServerProc) -> None:
    before = server.metric("kvpipe_engine_generated_tokens_total")
    chat(server)
    assert server.metric("kvpipe_engine_generated_tokens_total") == before + 40
    assert server.metric("kvpipe_worker_info", 'name="decode7"') == 1
    deadline = time.monotonic() + 10  # the log is written by the server process: let it flush
    while "Decode batch." not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = server.log().splitlines()
    assert any("Prefill batch. #new-seq: 1, #new-token: " in line for line in lines)
    decode = [line for line in lines if "Decode batch. #running-req: " in line]
    assert decode and all("accept len: " in line and "gen throughput (token/s): " in line for line in decode)
