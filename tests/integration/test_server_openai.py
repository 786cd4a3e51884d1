"""OpenAI-compatible routes of `kvpipe serve`, driven by the official `openai` client over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.engine import CONTEXT_FACTOR
from tests.helpers.server import ServerProc, server_fixture
from tests.helpers.tolerance import Generation, Route, assert_same_generations, generation_atol

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerProc]:
    # a context of 128 tokens keeps chat without max_tokens short
    yield from server_fixture(
        tiny_model_dir, tmp_path_factory.mktemp("srv"), "--context-length", "128", "--served-model-name", MODEL
    )


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_stream_matches_native(client: openai.OpenAI, server: ServerProc) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens <= 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the chat template is the tokenizer's: the same prompt through /generate gives the same text
    ids = Tokenizer.from_dir(Path(server.get("/model_info").json()["model_path"])).encode_chat(MESSAGES)
    assert len(ids) == r.usage.prompt_tokens
    native = server.post(
        "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    ).json()
    assert native["text"] == choice.message.content


def test_chat_content_parts_and_max_completion_tokens(client: openai.OpenAI) -> None:
    """Content parts are joined into the same prompt as the plain string (same tokens and logprobs),
    and the answer depends on that content: other parts, or none, give another answer (every chat
    prompt ends in the same template tokens, so only the context can tell them apart)."""

    def chat(content, **limit) -> tuple[Generation, str]:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, logprobs=True, **limit
        )
        assert r.usage.completion_tokens <= 4
        lps = r.choices[0].logprobs.content
        return Generation(tuple(c.token for c in lps), tuple(c.logprob for c in lps)), r.choices[0].message.content

    parts, text = chat([{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}], max_completion_tokens=4)
    plain, plain_text = chat("Say hi", max_tokens=4)
    # one server process, one prompt at a time: Route.SAME_PROCESS
    assert_same_generations([parts], [plain], Route.SAME_PROCESS, what="content parts vs the same string")
    assert text == plain_text
    floor = CONTEXT_FACTOR * generation_atol(Route.ACROSS_PROCESSES, [plain])
    for other in ([{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story"}], ""):
        got, _ = chat(other, max_completion_tokens=4)
        assert got.tokens != plain.tokens, (other, got, plain)
        assert got.tokens[0] != plain.tokens[0] or abs(got.logprobs[0] - plain.logprobs[0]) > floor, (other, got, plain)


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, seed=7)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_without_max_tokens_stops_at_context(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 128


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    # default max_tokens is OpenAI's 16
    d = client.completions.create(model=MODEL, prompt="Once", temperature=0, extra_body={"ignore_eos": True})
    assert d.usage.completion_tokens == 16


def test_completions_batch_and_token_prompt(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    single = client.completions.create(model=MODEL, prompt="two", max_tokens=4, temperature=0)
    assert next(c.text for c in r.choices if c.index == 1) == single.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, logprobs=0)
    lp = ids.choices[0].logprobs
    assert len(lp.token_logprobs) == ids.usage.completion_tokens and all(x <= 0 for x in lp.token_logprobs)


def test_completions_finish_reason_and_matched_stop(server: ServerProc) -> None:
    prompt = [5, 6, 7, 8]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    base = server.post("/v1/completions", json=body).json()["choices"][0]
    assert base["finish_reason"] == "length" and "matched_stop" not in base
    ids = server.post(
        "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}},
    ).json()["output_ids"]
    # stop on the 3rd generated token id: OpenAI's "stop", and SGLang's matched_stop names the token
    r = server.post("/v1/completions", json={**body, "stop_token_ids": [ids[2]]}).json()["choices"][0]
    assert (r["finish_reason"], r["matched_stop"]) == ("stop", ids[2])
    streamed = [
        json.loads(line[6:])
        for line in server.post(
            "/v1/completions", json={**body, "stop_token_ids": [ids[2]], "stream": True}
        ).text.splitlines()
        if line.startswith("data: {")
    ]
    last = [c["choices"][0] for c in streamed if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [(c["finish_reason"], c["matched_stop"]) for c in last] == [("stop", ids[2])]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(c.logprob <= 0 for c in content)


def test_chat_logprob_bytes_rebuild_split_characters(
    server: ServerProc, client: openai.OpenAI, tiny_model_dir: Path
) -> None:
    """`bytes` of each token are its own bytes: joined, they decode to the tokens' text even where
    a token holds only part of a UTF-8 character (the random model emits many such bytes)."""
    tok = Tokenizer.from_dir(tiny_model_dir)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    body = {"input_ids": tok.encode_chat(MESSAGES), "sampling_params": {"max_new_tokens": 32, "temperature": 0}}
    ids = server.post("/generate", json=body).json()["output_ids"]
    assert len(content) == len(ids)
    joined = b"".join(bytes(c.bytes or []) for c in content)
    assert joined.decode("utf-8", errors="replace") == tok.decode(ids, skip_special_tokens=False)
    assert [bytes(c.bytes or []) for c in content] == [tok.token_bytes(i) for i in ids]
    partial = 0
    for c, i in zip(content, ids):
        assert c.token == tok.decode([i], skip_special_tokens=False)
        if "\ufffd" not in c.token:
            assert bytes(c.bytes or []) == c.token.encode()
        else:  # part of a character: its own bytes (the tiny vocabulary has no U+FFFD token)
            partial += 1
            assert bytes(c.bytes or []) != "\ufffd".encode() and len(c.bytes or []) >= 1
    assert partial > 0  # the greedy answer has such tokens, so the check above ran


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"model": "no-such-model"}, openai.NotFoundError),
        ({"n": 2}, openai.BadRequestError),
        ({"max_tokens": 0}, openai.BadRequestError),
        ({"max_tokens": -1}, openai.BadRequestError),
        ({"max_tokens": 100_000}, openai.BadRequestError),
        ({"temperature": -1.0}, openai.BadRequestError),
        ({"top_p": 2.0}, openai.BadRequestError),
        ({"messages": []}, openai.BadRequestError),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            openai.BadRequestError,
        ),
        ({"presence_penalty": 0.5}, openai.BadRequestError),
    ],
)
def test_chat_bad_requests(client: openai.OpenAI, server: ServerProc, kwargs: dict, error: type) -> None:
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as info:
        client.chat.completions.create(**args)
    assert info.value.body and "message" in info.value.body
    assert server.get("/health").status_code == 200


def test_completions_bad_requests(server: ServerProc) -> None:
    for body in (
        {"model": MODEL, "prompt": ""},
        {"model": MODEL, "prompt": []},
        {"model": MODEL, "prompt": 3},
        {"model": MODEL, "prompt": "x", "echo": True},
        {"model": MODEL, "prompt": [10**7]},
        {"model": MODEL, "prompt": "x", "max_tokens": "3"},
    ):
        r = server.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) >= {"message", "type", "code"}
    r = server.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert httpx.get(server.url + "/health").status_code == 200
