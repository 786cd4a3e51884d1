"""`kvpipe serve` over real HTTP on loopback: SGLang native API, info routes, metrics, errors,
client disconnects, the HTTP/2 probe sglang-router sends."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.server import ServerProc, server_fixture, sse_events

pytestmark = pytest.mark.timeout(300)

GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    # small pages so a request holds several; served under an explicit name
    yield from server_fixture(
        tiny_model_dir,
        tmp_path_factory.mktemp("srv"),
        "--page-size",
        "16",
        "--max-total-tokens",
        "16384",
        "--served-model-name",
        "tiny-test",
    )


def _stream(server: ServerProc, body: dict) -> list[dict | str]:
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(r.iter_lines()))


def test_health_and_info(server: ServerProc) -> None:
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200
    for path in ("/server_info", "/get_server_info"):
        info = server.get(path).json()
        assert info["served_model_name"] == "tiny-test"
        assert Path(info["model_path"]).is_dir() and Path(info["tokenizer_path"]).is_dir()
        assert info["tp_size"] == 1 and info["page_size"] == 16 and info["context_length"] == 8192
        assert info["disaggregation_mode"] == "null" and info["version"]
        assert info["dtype"] == info["kv_cache_dtype"] == "auto"
        assert info["internal_states"][0]["total_pages"] == 16384 // 16
    for path in ("/model_info", "/get_model_info"):
        mi = server.get(path).json()
        assert mi["is_generation"] is True and mi["served_model_name"] == "tiny-test"
        assert Path(mi["model_path"]).is_dir()


def test_generate_text_and_ids_agree(server: ServerProc) -> None:
    r = server.post("/generate", json={"text": "Hello world", "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] > 0
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0 and meta["cached_tokens"] == 0
    assert isinstance(out["text"], str) and meta["id"]
    # the same prompt as token ids gives the same greedy tokens
    tok = Tokenizer.from_dir(Path(server.get("/model_info").json()["model_path"]))
    ids = tok.encode("Hello world")
    r2 = server.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY, "rid": "fixed-rid-1"})
    assert r2.json()["output_ids"] == out["output_ids"]
    assert r2.json()["meta_info"]["id"] == "fixed-rid-1"
    assert r2.json()["meta_info"]["prompt_tokens"] == len(ids) == meta["prompt_tokens"]


def test_stream_final_equals_non_stream(server: ServerProc) -> None:
    body = {"text": "The quick brown fox", "sampling_params": {**GREEDY, "max_new_tokens": 20, "ignore_eos": True}}
    full = server.post("/generate", json=body).json()
    events = _stream(server, body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert len(chunks) >= 2  # really streamed, not one final blob
    # cumulative: each event extends the previous one
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 20}


def test_batched_generate(server: ServerProc) -> None:
    prompts = ["Hello", "Goodbye cruel world", "A"]
    r = server.post("/generate", json={"text": prompts, "sampling_params": GREEDY})
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 3
    singles = [server.post("/generate", json={"text": p, "sampling_params": GREEDY}).json() for p in prompts]
    assert [o["output_ids"] for o in outs] == [s["output_ids"] for s in singles]
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    # per-prompt sampling params and batched streaming with an index per event
    events = _stream(
        server,
        {
            "text": prompts[:2],
            "sampling_params": [
                {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
                {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            ],
        },
    )
    finals = {e["index"]: e for e in events if isinstance(e, dict) and e["meta_info"]["finish_reason"]}
    assert {i: len(e["output_ids"]) for i, e in finals.items()} == {0: 3, 1: 5}


def test_logprobs_and_bootstrap_fields(server: ServerProc) -> None:
    body = {
        "text": "Hi",
        "sampling_params": GREEDY,
        "return_logprob": True,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": None,
        "bootstrap_room": 12345,
    }
    out = server.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert "input_token_logprobs" in meta
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(lp <= 0.0 for lp, _, _ in lps) and lps[0][2] is None


def test_stop_string_and_stop_token(server: ServerProc) -> None:
    base = server.post(
        "/generate", json={"text": "Tell me", "sampling_params": {**GREEDY, "max_new_tokens": 16, "ignore_eos": True}}
    ).json()
    ids = base["output_ids"]
    # stop at the 4th generated token id: it stays in output_ids, finish says which
    r = server.post(
        "/generate",
        json={
            "text": "Tell me",
            "sampling_params": {**GREEDY, "max_new_tokens": 16, "ignore_eos": True, "stop_token_ids": [ids[3]]},
        },
    ).json()
    first = ids.index(ids[3])
    assert r["output_ids"] == ids[: first + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}
    # a stop string taken from the middle of the text is trimmed away
    text = base["text"]
    stop = next(
        (
            text[i : i + 2]
            for i in range(2, len(text) - 2)
            if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
        ),
        None,
    )
    if stop is None:
        pytest.skip("greedy text has no usable stop string")
    r = server.post(
        "/generate",
        json={
            "text": "Tell me",
            "sampling_params": {**GREEDY, "max_new_tokens": 16, "ignore_eos": True, "stop": [stop]},
        },
    ).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["text"] == text[: text.index(stop)]
    streamed = _stream(
        server,
        {"text": "Tell me", "sampling_params": {**GREEDY, "max_new_tokens": 16, "ignore_eos": True, "stop": stop}},
    )
    texts = [e["text"] for e in streamed if isinstance(e, dict)]
    assert texts[-1] == r["text"] and all(stop not in t for t in texts)


BAD_BODIES = [
    ({"text": "x", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**9}}, "context length"),
    ({"text": "x", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"text": "x", "sampling_params": {"top_p": 0.0}}, "top_p"),
    ({"text": "x", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "x", "sampling_params": {"n": 2}}, "n=1"),
    ({"text": ""}, "empty"),
    ({"input_ids": []}, "empty"),
    ({"text": "x", "input_ids": [1, 2]}, "not both"),
    ({}, "required"),
    ({"input_ids": [1, 2, 10**6]}, "vocabulary"),
    ({"input_ids": [1, -2]}, "vocabulary"),
    ({"text": 5}, "text"),
    ({"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
    ({"text": "x", "sampling_params": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
]


@pytest.mark.parametrize("body,needle", BAD_BODIES)
def test_bad_requests_are_4xx(server: ServerProc, body: dict, needle: str) -> None:
    r = server.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400
    assert server.get("/health").status_code == 200


def test_malformed_json_and_unknown_routes(server: ServerProc) -> None:
    for raw in (b"{not json", b"", b"[1, 2]", b"\xff\xfe"):
        r = server.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json(), (raw, r.text)
    r = server.get("/no_such_route")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    assert server.get("/generate").status_code == 405
    # after all of that the server still generates
    assert server.post("/generate", json={"text": "ok", "sampling_params": GREEDY}).status_code == 200


def test_duplicate_rid_fails_only_that_request(server: ServerProc) -> None:
    body = {"text": "dup", "rid": "same-rid", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r.iter_lines())
        assert isinstance(next(events), dict)  # the first request is running
        dup = server.post("/generate", json=body)
        assert dup.status_code == 400 and "already running" in dup.json()["error"]["message"]
        assert server.post("/abort_request", json={"rid": "same-rid"}).json() == {"aborted": 1}
        rest = [e for e in events if isinstance(e, dict)]
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    server.wait_idle()


def test_metrics_change_after_requests(server: ServerProc) -> None:
    # absent series read as 0, so this holds whichever tests of the module ran before
    gen0 = server.metric("kvpipe_generation_tokens_total")
    prompt0 = server.metric("kvpipe_prompt_tokens_total")
    length0 = server.metric("kvpipe_requests_total", 'finish_reason="length"')
    ttft0 = server.metric("kvpipe_time_to_first_token_seconds_count")
    out = server.post(
        "/generate",
        json={"text": "count me", "sampling_params": {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True}},
    ).json()
    assert server.metric("kvpipe_generation_tokens_total") == gen0 + 7
    assert server.metric("kvpipe_prompt_tokens_total") == prompt0 + out["meta_info"]["prompt_tokens"]
    assert server.metric("kvpipe_requests_total", 'finish_reason="length"') == length0 + 1
    assert server.metric("kvpipe_time_to_first_token_seconds_count") == ttft0 + 1
    assert server.metric("kvpipe_free_pages") == server.metric("kvpipe_total_pages") > 0
    text = server.get("/metrics").text  # the series this request made exist (TPOT needs 2+ tokens)
    for name in (
        "kvpipe_requests_total",
        "kvpipe_time_to_first_token_seconds_bucket",
        "kvpipe_time_per_output_token_seconds_bucket",
        "kvpipe_e2e_request_latency_seconds_count",
        "kvpipe_num_running_reqs",
        "kvpipe_num_waiting_reqs",
        "kvpipe_free_pages",
    ):
        assert name in text, name


def test_stream_disconnect_frees_pages(server: ServerProc) -> None:
    idle = server.wait_idle()
    aborts0 = server.metric("kvpipe_requests_total", 'finish_reason="abort"')
    lengths0 = server.metric("kvpipe_requests_total", 'finish_reason="length"')
    body = {"text": "long " * 40, "stream": True, "sampling_params": {"max_new_tokens": 6000, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
        for _ in range(3):
            assert isinstance(next(events), dict)
        assert server.engine_stats()["free_pages"] < idle["free_pages"]  # it holds pages now
    # leaving the `with` closed the connection mid-stream
    assert server.wait_idle()["free_pages"] == idle["free_pages"]
    assert server.metric("kvpipe_requests_total", 'finish_reason="abort"') == aborts0 + 1
    assert server.metric("kvpipe_requests_total", 'finish_reason="length"') == lengths0


@pytest.mark.parametrize(
    "path,request_body",
    [
        ("/generate", {"text": "bye " * 10, "sampling_params": {"max_new_tokens": 6000, "ignore_eos": True}}),
        ("/v1/completions", {"prompt": "bye " * 10, "max_tokens": 6000, "ignore_eos": True}),
    ],
)
def test_non_stream_disconnect_aborts(server: ServerProc, path: str, request_body: dict) -> None:
    idle = server.wait_idle()
    aborts0 = server.metric("kvpipe_requests_total", 'finish_reason="abort"')
    body = json.dumps(request_body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % path.encode()
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        deadline = time.monotonic() + 30
        while server.engine_stats()["num_running"] == 0:  # wait until it is admitted
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert server.wait_idle()["free_pages"] == idle["free_pages"]
    assert server.metric("kvpipe_requests_total", 'finish_reason="abort"') == aborts0 + 1


def test_http2_prior_knowledge_probe_survived(server: ServerProc) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    settings_frame = bytes.fromhex("000000040000000000")  # empty SETTINGS
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings_frame)
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 4")  # an error, not a hang and not HTTP/2
    assert server.alive()
    assert server.get("/health").status_code == 200
    assert server.post("/generate", json={"text": "still here", "sampling_params": GREEDY}).status_code == 200


def test_prefix_cache_reports_cached_tokens(server: ServerProc) -> None:
    """A repeated prompt is served from the prefix cache (whole pages of 16, the last token always
    computed) with the same tokens, natively and in OpenAI's usage."""
    ids = list(range(5, 5 + 40))  # 2 whole pages + 8 tokens
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    first = server.post("/generate", json=body).json()
    second = server.post("/generate", json=body).json()
    assert second["output_ids"] == first["output_ids"]
    assert second["meta_info"]["cached_tokens"] == 32
    usage = server.post(
        "/v1/completions", json={"model": "tiny-test", "prompt": ids, "max_tokens": 2, "temperature": 0}
    ).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 32
