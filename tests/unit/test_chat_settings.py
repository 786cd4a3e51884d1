"""`kvpipe chat`'s sampling settings: safe defaults, `/set`, and what each turn sends."""

from __future__ import annotations

import io

import httpx
import pytest

from kvpipe.commands.chat import DEFAULT_MAX_TOKENS, ChatClient, ChatLoop, Conversation, Sampling


def test_defaults_are_bounded_and_low_temperature() -> None:
    s = Sampling()
    assert 0 < s.max_tokens == DEFAULT_MAX_TOKENS <= 512
    assert 0 < s.temperature < 1
    assert s.describe() == f"max_tokens {DEFAULT_MAX_TOKENS}, temperature 0.3"


def test_set_changes_one_setting() -> None:
    s = Sampling()
    assert s.with_setting("/set max_tokens 40") == Sampling(40, s.temperature)
    assert s.with_setting("/set  temperature   0") == Sampling(s.max_tokens, 0.0)
    assert s.with_setting("/set max-tokens 7").max_tokens == 7


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/set max_tokens", "usage: /set"),
        ("/set max_tokens 0", "max_tokens must be positive"),
        ("/set max_tokens many", "/set max_tokens: invalid literal"),
        ("/set temperature -1", "temperature must be >= 0"),
        ("/set top_p 0.5", "unknown setting 'top_p'"),
    ],
)
def test_bad_set_says_why(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Sampling().with_setting(line)


def test_each_turn_sends_the_current_settings() -> None:
    client = ChatClient(httpx.Client(), "http://127.0.0.1:1", None)
    body = client.body([{"role": "user", "content": "hi"}], Sampling(12, 0.5))
    assert body["max_tokens"] == 12 and body["temperature"] == 0.5 and "model" not in body
    assert ChatClient(httpx.Client(), "http://x", "m").body([], Sampling())["model"] == "m"


def test_set_command_in_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = iter(["/set temperature 0.9", "/set max_tokens x", "/set"])

    def fake_input(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    out, err = io.StringIO(), io.StringIO()
    loop = ChatLoop(ChatClient(httpx.Client(), "http://127.0.0.1:1", None), Conversation(), out, err)
    assert loop.run("") == 0
    assert loop.sampling == Sampling(DEFAULT_MAX_TOKENS, 0.9)
    assert err.getvalue().splitlines() == [
        f"[settings] max_tokens {DEFAULT_MAX_TOKENS}, temperature 0.9",
        "kvpipe chat: /set max_tokens: invalid literal for int() with base 10: 'x'",
        f"[settings] max_tokens {DEFAULT_MAX_TOKENS}, temperature 0.9",
    ]
    assert not loop.conv.turns  # settings are not turns
