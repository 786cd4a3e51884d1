"""Greedy exactness (tokens and logprobs) of PD serving through sglang-router (Mooncake over
loopback TCP) against a colocated `kvpipe serve`: 30 prompts from 1 to 4,500 tokens, chunked
prefill on (a chunk size that does not divide into pages) and off, streaming and not; the official
`openai` client."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.pd_stack import Stack, generate, greedy, pd_body, start_stack
from tests.helpers.server import ServerProc, server_fixture
from tests.helpers.tolerance import Generation, Route, assert_same_generations

pytest.importorskip("mooncake.engine")

PAGE = ["--page-size", "16", "--max-total-tokens", "32768"]
LENS = [
    1,
    2,
    3,
    5,
    8,
    15,
    16,
    17,
    31,
    32,
    33,
    47,
    64,
    100,
    127,
    128,
    129,
    200,
    255,
    256,
    257,
    400,
    511,
    512,
    700,
    1000,
    1500,
    2048,
    3000,
    4500,
]
PROMPTS = [[random.Random(n).randrange(3, 290) for _ in range(n)] for n in LENS]
MAX_NEW = 8


@pytest.fixture(scope="module")
def colocated(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    yield from server_fixture(
        tiny_model_dir, tmp_path_factory.mktemp("colocated"), *PAGE, "--chunked-prefill-size", "-1"
    )


@pytest.fixture(scope="module")
def reference(colocated: ServerProc) -> list[Generation]:
    def one(ids: list[int]) -> Generation:
        body = {"input_ids": ids, "sampling_params": greedy(MAX_NEW), "return_logprob": True}
        return Generation.of(generate(colocated.url, body))

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, PROMPTS))


# 200 tokens per prefill step: chunks end mid-page (pages of 16), so partial pages wait for the next chunk.
@pytest.fixture(scope="module", params=["200", "-1"], ids=["chunked", "unchunked"])
def stack(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp(f"pd-{request.param}")
    s = start_stack(tiny_model_dir, log_dir, *PAGE, "--chunked-prefill-size", request.param)
    try:
        yield s
    finally:
        s.close()


def test_greedy_through_router_matches_colocated(stack: Stack, reference: list[Generation]) -> None:
    def one(i: int) -> dict:
        body = {
            "input_ids": PROMPTS[i],
            "sampling_params": greedy(MAX_NEW),
            "stream": i % 2 == 1,
            "return_logprob": True,
        }
        return generate(stack.router, body)

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(len(PROMPTS))))
    try:
        # other processes than the colocated server's, and other batches: Route.ACROSS_PROCESSES
        got = [Generation.of(out) for out in outs]  # the router prepends the prefill's (empty) input logprobs
        assert_same_generations(got, reference, Route.ACROSS_PROCESSES, PROMPTS)
    except AssertionError:
        print(stack.logs())
        raise
    for i, out in enumerate(outs):
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["prompt_tokens"] == LENS[i]
        if i % 2:
            assert out["num_events"] >= 2  # streamed from the decode, not one blob
    p, d = stack.prefill.wait_idle(), stack.decode.wait_idle()
    assert p["disaggregation"]["rooms_succeeded"] >= len(PROMPTS) and p["disaggregation"]["rooms_failed"] == 0
    assert d["disaggregation"]["rooms_succeeded"] >= len(PROMPTS) and d["disaggregation"]["rooms_failed"] == 0


def test_server_info_and_modes(stack: Stack, colocated: ServerProc) -> None:
    for srv, mode in ((stack.prefill, "prefill"), (stack.decode, "decode"), (colocated, "null")):
        info = srv.get("/server_info").json()
        assert info["disaggregation_mode"] == mode and info["served_model_name"]
        assert Path(info["model_path"]).is_dir()  # only local paths (the router downloads anything else)
        st = info["internal_states"][0]
        assert st["free_pages"] == st["total_pages"] == 32768 // 16
    # Without bootstrap info a PD server refuses the request; the prefill never streams.
    for srv in (stack.prefill, stack.decode):
        r = srv.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": greedy(2)})
        assert r.status_code == 400 and "bootstrap" in r.json()["error"]["message"]


def test_openai_client_streams_through_router(stack: Stack, colocated: ServerProc) -> None:
    model = colocated.get("/v1/models").json()["data"][0]["id"]
    ref = openai.OpenAI(base_url=colocated.url + "/v1", api_key="none", max_retries=0)
    pd = openai.OpenAI(base_url=stack.router + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Tell me about disaggregated serving."}]
    want = ref.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    chunks = list(pd.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content and len(chunks) > 2
    assert chunks[-1].choices[0].finish_reason == want.choices[0].finish_reason

    want_c = ref.completions.create(model=model, prompt="The quick brown fox", max_tokens=10, temperature=0)
    got = list(
        pd.completions.create(model=model, prompt="The quick brown fox", max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in got if c.choices) == want_c.choices[0].text
    non_stream = pd.completions.create(model=model, prompt="The quick brown fox", max_tokens=10, temperature=0)
    assert non_stream.choices[0].text == want_c.choices[0].text
    stack.prefill.wait_idle()
    stack.decode.wait_idle()


def test_prefill_answers_plain_json(stack: Stack) -> None:
    """What the router reads from the prefill: one JSON body even for a streaming request."""
    body = pd_body(
        stack, {"input_ids": PROMPTS[20], "sampling_params": greedy(4), "stream": True, "return_logprob": True}
    )
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(httpx.post, stack.prefill.url + "/generate", json=body, timeout=60)
        d = pool.submit(generate, stack.decode.url, body)
        p_resp, d_out = p.result(), d.result()
    assert p_resp.status_code == 200 and p_resp.headers["content-type"].startswith("application/json")
    pj = p_resp.json()
    assert pj["meta_info"]["input_token_logprobs"] == [] and pj["output_ids"] == d_out["output_ids"][:1]
