"""`bench serve --api chat`: the workload's ids as text (the presets' real tokenizer), the chat
body, the server's prompt-token count recorded and summed, refusals (several turns, no tokenizer).
The driver's HTTP side is answered by httpx's MockTransport, as in test_bench_driver.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvpipe.bench.serve.chat_text import ChatText, open_chat_text
from kvpipe.bench.serve.compare import COMPARE_KEYS, compare_table
from kvpipe.bench.workload import WorkloadConfig, build_workload, parse_lengths
from kvpipe.harness.answers import prompt_tokens
from kvpipe.harness.driver import drive
from kvpipe.harness.latency import summarize
from kvpipe.harness.request import Api
from kvpipe.model.presets.tokenizer import SPECIAL_TOKENS, build_tokenizer
from kvpipe.model.text.tokenizer import Tokenizer

# the presets' byte-level BPE: ids 0..255 are bytes, then English merges (ASCII), then specials
TEXT = ChatText(Tokenizer(build_tokenizer()))


def _cfg(api: Api = Api.CHAT, **kw) -> WorkloadConfig:
    base = dict(
        prompt_lens=parse_lengths("12,20"),
        output_lens=parse_lengths("3"),
        num_requests=4,
        vocab_size=TEXT.vocab_size,
        token_id_low=256,  # merges and specials only: the text is the merges' ASCII, specials dropped
        seed=5,
        api=api,
    )
    return WorkloadConfig(**(base | kw))


def test_chat_workload_is_the_generate_ids_as_one_user_message() -> None:
    ids = build_workload(_cfg(Api.GENERATE)).requests
    chat = build_workload(_cfg(), TEXT).requests
    specials = {TEXT.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    for g, c in zip(ids, chat, strict=True):
        assert c.api is Api.CHAT and c.api.path == "/v1/chat/completions"
        assert isinstance(c.prompt, str) and c.prompt == TEXT.tokenizer.decode(list(g.prompt))
        assert (c.max_tokens, c.arrival_s, c.index) == (g.max_tokens, g.arrival_s, g.index)
        assert "<|" not in c.prompt  # special ids are dropped, never written into the message
        kept = [t for t in g.prompt if t not in specials]
        assert c.prompt == "".join(TEXT.tokenizer.decode([t]) for t in kept)
        body = c.body("m")
        assert body["messages"] == [{"role": "user", "content": c.prompt}]
        assert (body["max_tokens"], body["ignore_eos"], body["temperature"], body["stream"]) == (3, True, 0.0, True)
        assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"
        assert "model" not in c.body()  # no name: the server serves its own model


def test_chat_shared_prefix_stays_a_shared_text_head() -> None:
    w = build_workload(_cfg(num_prefix_groups=2, prefix_len=8), TEXT)
    ids = build_workload(_cfg(Api.GENERATE, num_prefix_groups=2, prefix_len=8)).requests
    for g in (0, 1):
        same = [r.prompt for r in w.requests if w.prefix_group(r.index) == g]
        head = TEXT(ids[g].prompt[:8])
        assert len(same) == 2 and head and all(isinstance(p, str) and p.startswith(head) for p in same)
    assert not str(w.requests[1].prompt).startswith(TEXT(ids[0].prompt[:8]))  # another group, another head


def test_chat_refusals() -> None:
    with pytest.raises(ValueError, match="multi-turn"):
        _cfg(num_turns=2, turn_len=4)
    with pytest.raises(ValueError, match="generate or chat"):
        _cfg(Api.COMPLETION)
    with pytest.raises(ValueError, match="tokenizer"):
        build_workload(_cfg())
    with pytest.raises(SystemExit, match="--model-path"):
        open_chat_text(None)


def test_prompt_tokens_of_answers() -> None:
    assert prompt_tokens(Api.GENERATE, {"meta_info": {"prompt_tokens": 9}}) == 9
    assert prompt_tokens(Api.CHAT, {"choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": 2}}) == 31
    assert prompt_tokens(Api.CHAT, {"choices": [{"delta": {"content": "x"}}], "usage": None}) is None
    assert prompt_tokens(Api.GENERATE, {"meta_info": {"prompt_tokens": True}}) is None


def _chat_stream(n: int, rendered: int) -> bytes:
    events: list[object] = [
        {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None if i < n else "length"}]}
        for i in range(1, n + 1)
    ]
    events.append({"choices": [], "usage": {"prompt_tokens": rendered, "completion_tokens": n}})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_driver_records_the_servers_rendered_prompt_tokens() -> None:
    """The summary's input tokens are the server's counts (here: its characters + 10 template
    tokens, what this fake server says it rendered), not the requested lengths."""
    wl = build_workload(_cfg(), TEXT)
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        body = json.loads(request.content)
        content = body["messages"][0]["content"]
        return httpx.Response(200, content=_chat_stream(body["max_tokens"], len(content) + 10))

    res = asyncio.run(
        drive("http://bench.test", wl.requests, concurrency=2, deadline_s=30, transport=httpx.MockTransport(handler))
    )
    assert paths == ["/v1/chat/completions"] * 4
    assert all(o.ok for o in res.outcomes), [o.reason for o in res.outcomes]
    want = [len(str(r.prompt)) + 10 for r in wl.requests]
    assert [o.prompt_tokens for o in res.outcomes] == want and want != [12, 20, 12, 20]
    s = summarize(res.outcomes, 1.0)
    assert s["total_input_tokens"] == sum(want) and s["prompt_tokens_mean"] == sum(want) / 4
    assert "prompt_tokens_unreported" not in s


def test_text_prompt_without_a_server_count_is_not_counted_as_tokens() -> None:
    wl = build_workload(_cfg(num_requests=2), TEXT)

    def handler(request: httpx.Request) -> httpx.Response:
        n = json.loads(request.content)["max_tokens"]
        stream = _chat_stream(n, 0).replace(b'"prompt_tokens": 0, ', b"")  # usage without prompt_tokens
        return httpx.Response(200, content=stream)

    res = asyncio.run(
        drive("http://bench.test", wl.requests, concurrency=1, deadline_s=30, transport=httpx.MockTransport(handler))
    )
    assert all(o.ok and o.prompt_tokens is None for o in res.outcomes)
    s = summarize(res.outcomes, 1.0)
    assert s["total_input_tokens"] == 0 and s["prompt_tokens_mean"] is None and s["prompt_tokens_unreported"] == 2


def test_compare_table_names_the_rendered_prompt_length() -> None:
    side = {**dict.fromkeys(COMPARE_KEYS, 1.0), "completed": 1, "failed": 0, "prompt_tokens_mean": None}
    row = {
        "prompt_len": 24,
        "ratio": dict.fromkeys(COMPARE_KEYS, 1.0),
        "pd": {**side, "prompt_tokens_mean": 33.0},
        "colocated": dict(side),
    }
    assert "prompt 24 tokens, 33 as the server counted them (ms)" in compare_table([row], {})
    row["pd"]["prompt_tokens_mean"] = 24.0
    assert "prompt 24 tokens (ms)" in compare_table([row], {})
