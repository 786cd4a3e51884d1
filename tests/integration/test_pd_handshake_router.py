"""Mismatched prefill and decode behind sglang-router, tried as a new user would (issue 26):
prefill `--page-size 16`, decode `--page-size 64`. Before the handshake work the decode logged the
mismatch at once while the prefill waited out its 30 s bootstrap timeout and answered 500, which
the router retried 5 times (150 s per request). Now the first request fails on both sides with
the reason (native /generate: SGLang's abort with the message on both servers, which
sglang-router 0.3.2 does not retry, while it retries every error status of either server, 409
included: each side counts exactly one refusal), and no page is left behind. Then the decode
restarts with another KV dtype, then with another checkpoint served under the same name (refused
alike), then matching (serves): those restarts are `slow` (test_pd_handshake_inprocess.py covers
the cases in `make test`). One stack for the module; tests run in order. No test times anything:
the client's timeout is far below the prefill's 30 s bootstrap timeout, and each answer must name
the handshake's reason."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvpipe.model.presets.writer import write_preset
from kvpipe.transfer.control.handshake import REFUSED
from tests.helpers.pd_stack import Stack, generate, greedy, pd_body, start_stack, wait_for

pytest.importorskip("mooncake.engine")

CLIENT_S = 8.0  # a client's patience: far below the prefill's 30 s bootstrap timeout
METRIC = "kvpipe_pd_handshakes_refused_total"
PROMPT = [(i * 7919) % 280 + 3 for i in range(40)]
BODY = {"input_ids": PROMPT, "sampling_params": greedy(4)}


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        tiny_model_dir,
        tmp_path_factory.mktemp("pd-handshake"),
        "--served-model-name",
        "tiny",
        "--page-size",
        "16",
        "--disaggregation-bootstrap-timeout",
        "30",
        decode_args=("--page-size", "64"),
    )
    try:
        yield s
    finally:
        s.close()


def refusals(stack: Stack, label: str) -> tuple[float, float]:
    return stack.prefill.metric(METRIC, f'reason="{label}"'), stack.decode.metric(METRIC, f'reason="{label}"')


def through_router(stack: Stack) -> httpx.Response:
    """One request through the router; a router that has no healthy decode yet (restarted a
    moment ago) answers 503 before choosing workers: that is retried until it chooses."""

    def attempt() -> httpx.Response | None:
        r = httpx.post(stack.router + "/generate", json=BODY, timeout=CLIENT_S)
        return None if r.status_code == 503 and "server_selection_failed" in r.text else r

    return wait_for(attempt, 60.0, "the router to choose workers", interval_s=0.5)


def assert_refused_once(stack: Stack, label: str, words: str) -> None:
    before = refusals(stack, label)
    r = through_router(stack)
    # the decode's native answer: SGLang's finish_reason "abort" with the reason (an error status
    # of either server would make sglang-router 0.3.2 retry it 4 more times, whatever the status)
    assert r.status_code == 200, r.text
    finish = r.json()["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and REFUSED in finish["message"] and words in finish["message"], finish
    # exactly one more refusal on each side: the router did not retry the 409
    want = (before[0] + 1, before[1] + 1)
    wait_for(lambda: refusals(stack, label) == want, 10.0, f"one refusal counted on each side ({want})")
    for srv in (stack.prefill, stack.decode):
        srv.wait_idle(10.0)  # every page free, nothing running or waiting
    assert stack.prefill.engine_stats()["disaggregation"]["transfer_rooms"] == 0


def restart_decode(stack: Stack, *flags: str) -> None:
    os.killpg(stack.decode.proc.pid, signal.SIGKILL)
    stack.decode.proc.wait(10)
    stack.restart("decode", *flags)


def test_page_size_mismatch_fails_fast_through_the_router(stack: Stack) -> None:
    assert_refused_once(stack, "page_size", "page size: prefill 16, decode 64")


def both(stack: Stack, path: str, body: dict) -> list[httpx.Response]:
    """`body` posted to prefill and decode at once with the same room, as the router does."""
    body = pd_body(stack, body)
    with ThreadPoolExecutor(2) as pool:
        urls = (stack.prefill.url, stack.decode.url)
        return list(pool.map(lambda url: httpx.post(url + path, json=body, timeout=CLIENT_S), urls))


def test_both_servers_answer_the_reason(stack: Stack) -> None:
    """Each server answers with the reason, well before the prefill's bootstrap timeout: native
    /generate with SGLang's abort, the OpenAI routes with 409."""
    words = "page size: prefill 16, decode 64"
    for r in both(stack, "/generate", BODY):
        assert r.status_code == 200, r.text
        finish = r.json()["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and words in finish["message"], finish
    completion = {"model": "tiny", "prompt": "the handshake", "max_tokens": 4}
    for r in both(stack, "/v1/completions", completion):
        assert r.status_code == 409 and words in r.json()["error"]["message"], r.text
    for srv in (stack.prefill, stack.decode):
        srv.wait_idle(10.0)


@pytest.mark.slow  # a decode restart each; the in-process pair covers the case in `make test`
def test_another_kv_dtype_is_refused(stack: Stack) -> None:
    restart_decode(stack, "--page-size", "16", "--kv-cache-dtype", "fp8_e4m3")
    assert_refused_once(stack, "kv_dtype", "KV cache dtype: prefill 'float32', decode 'float8_e4m3fn'")


@pytest.mark.slow  # a decode restart each; the in-process pair covers the case in `make test`
def test_another_checkpoint_under_the_same_name_is_refused(stack: Stack, tmp_path: Path) -> None:
    other = write_preset("tiny", tmp_path / "tiny", seed=1)
    restart_decode(stack, "--page-size", "16", "--model-path", str(other))
    assert_refused_once(stack, "model", "model (checkpoint digest): prefill '")


@pytest.mark.slow  # a decode restart each; the in-process pair covers the case in `make test`
def test_a_matching_decode_serves(stack: Stack, tiny_model_dir: Path) -> None:
    restart_decode(stack, "--page-size", "16", "--model-path", str(tiny_model_dir))
    out = wait_for(lambda: _served(stack), 60.0, "a successful request through the router", interval_s=0.5)
    assert len(out["output_ids"]) == 4


def _served(stack: Stack) -> dict | None:
    try:
        out = generate(stack.router, BODY, timeout_s=30.0)
    except (AssertionError, httpx.HTTPError):
        return None
    return out if out["meta_info"]["finish_reason"]["type"] == "length" else None
