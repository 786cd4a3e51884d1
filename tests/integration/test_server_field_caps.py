"""Issue 45, finding 4: size caps bypassed before tokenizing. A 20 MB chat `role`, or a content
part whose `text` is a list of 2.5M integers, was rendered and tokenized (27 s and 15 s of CPU)
before the 400; bad items in a long `input_ids` or `prompt` made pydantic list every one of them
(a 300 MB error message). Each is now refused by the cheap check on the parsed JSON
(kvpipe/server/body_check.py), like ordinary oversized content: the same 400 shape, a message
naming the field, and neither the chat template nor the tokenizer called. Against a real engine
on the tiny model, in process; afterwards the server holds nothing and serves again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.server.app_state import ServerState
from tests.helpers.app_client import app_client, assert_back_to_idle

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[TestClient, ServerState]]:
    cfg = ServerConfig(
        model_path=str(tiny_model_dir),
        cache=CacheConfig(page_size=16, max_total_tokens=8192),
        scheduler=SchedulerConfig(context_length=2048),
        log_level="warning",
    )
    with app_client(cfg) as served:
        yield served


class TokenizerCalls:
    """Counts what the loaded tokenizer is asked to render or encode (patched on the instance)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tok: Any) -> None:
        self.calls: list[str] = []
        for name in ("encode", "apply_chat_template"):
            monkeypatch.setattr(tok, name, self._counting(name, getattr(tok, name)))

    def _counting(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kw: Any) -> Any:
            self.calls.append(name)
            return fn(*args, **kw)

        return wrapped


def _post(client: TestClient, path: str, body: Any) -> Any:
    # sent as bytes: the test client would otherwise re-encode a 20 MB body for every retry
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def test_finding_4_oversized_fields_are_refused_before_the_tokenizer(
    served: tuple[TestClient, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, state = served
    assert _post(client, "/v1/chat/completions", {"messages": HI, "max_tokens": 1}).status_code == 200  # warm
    counter = TokenizerCalls(monkeypatch, state.tokenizer)
    ints = list(range(2_500_000))
    attacks: list[tuple[str, dict[str, Any], str, str]] = [
        # (route, body, the param named, words of the message)
        ("/v1/chat/completions", {"messages": [{"role": "u" * 20_000_000, "content": "hi"}]}, "messages.0.role",
         "has 20000000 characters: at most 256 are allowed (--max-field-size)"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": ints}]}]},
         "messages.0.content.0.text", "must be a string or null, not a list"),
        # the comparison: ordinary content of about the same size, refused by the same check
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 4_000_000}]},
         "messages.0.content", "characters: it cannot fit the model's context length"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "name": "n" * 10_000, "content": "hi"}]},
         "messages.0.name", "(--max-field-size)"),
        ("/v1/chat/completions", {"messages": HI, "logit_bias": {str(i): 1.0 for i in range(1_000_000)}},
         "logit_bias", "holds 1000000 entries"),
        ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}] * 100_000}, "tools",
         "(--max-field-size)"),
        ("/v1/chat/completions", {"messages": HI, "user": "x" * 1_000_000}, "user", "(--max-field-size)"),
        # pydantic used to list every bad item: a 300 MB message after 54 s
        ("/generate", {"input_ids": [1] + ["a"] * 2_500_000}, "input_ids", "context length is 2048 tokens"),
        ("/generate", {"input_ids": [1, *range(1000), "a"]}, "input_ids.1001", "must be an integer, not a string"),
        ("/v1/completions", {"prompt": [1] + [1.5] * 2_500_000}, "prompt", "context length is 2048 tokens"),
        ("/generate", {"text": "hi", "rid": "r" * 5_000_000}, "rid", "(--max-field-size)"),
        ("/generate", {"text": "hi", "sampling_params": {"stop": ["s"] * 100_000}}, "sampling_params.stop",
         "--max-stop-strings"),
    ]  # fmt: skip
    for path, body, param, words in attacks:
        r = _post(client, path, body)
        assert r.status_code == 400, (param, r.text[:500])
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (param, err)
        assert len(r.content) < 1000, (param, len(r.content))  # one line, not one per item
    assert counter.calls == [], "a refused body reached the chat template or the tokenizer"

    # a content part of another kind is refused before the template (which would refuse it too)
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    r = _post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": image}]})
    assert r.status_code == 400 and "'image_url' are not supported" in r.json()["error"]["message"], r.text
    assert counter.calls == []

    assert_back_to_idle(state)
    r = _post(
        client, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    )
    assert r.status_code == 200 and counter.calls == ["apply_chat_template", "encode"], (r.text, counter.calls)
    assert_back_to_idle(state)
