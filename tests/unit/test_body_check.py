"""The cheap check of a parsed body against the capped wire schemas (issue 45, finding 4), without
a server: it agrees with the wire models on types (so whatever it passes, pydantic takes), it
refuses exactly what is past a cap, and its work is bounded by the caps, not by the body (it
looks at a 2.5M-entry list once, not at its entries); hypothesis, bounded and derandomized like
the other fuzz suites."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from kvpipe.config import RequestLimits
from kvpipe.server import body_check
from kvpipe.server.body_check import Budget, check_body
from kvpipe.server.errors import APIError
from kvpipe.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvpipe.server.protocol import AbortRequest, GenerateRequest
from kvpipe.server.request_caps import apply_limits, budgets, request_defs
from kvpipe.server.validation import ModelLimits

FUZZ = settings(
    max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m for m in (GenerateRequest, CompletionRequest, ChatCompletionRequest, AbortRequest)
}
CAPS = RequestLimits(max_prompts_per_request=4, max_stop_strings=3, max_stop_string_chars=5, max_field_size=8)
MODEL = ModelLimits(vocab_size=100, context_length=16, max_prompt_chars=40)
HUGE = RequestLimits(
    max_prompts_per_request=10**9, max_stop_strings=10**9, max_stop_token_ids=10**9, max_field_size=10**9
)


def _schemas(limits: RequestLimits, model: ModelLimits | None) -> tuple[dict[str, Any], dict[str, Budget]]:
    defs = request_defs()
    apply_limits(defs, limits, model)
    return defs, budgets(model) if model is not None else {}


CAPPED, UNCAPPED = _schemas(CAPS, MODEL), _schemas(HUGE, None)


def _refusal(body: Any, model: str, schemas: tuple[dict[str, Any], dict[str, Budget]] = CAPPED) -> APIError | None:
    try:
        check_body(body, model, *schemas)
    except APIError as e:
        assert e.status == 400
        return e
    return None


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["type", "text", "role", "content", "name", "x"]), inner, max_size=3)
    ),
    max_leaves=8,
)
REQUIRED = {"CompletionRequest": {"prompt": "hi"}, "ChatCompletionRequest": {"messages": [{"role": "user"}]}}


def _fields(model: str) -> list[str]:
    return sorted(MODELS[model].model_json_schema()["properties"])


@FUZZ
@given(data=st.data(), model=st.sampled_from(sorted(MODELS)))
def test_the_check_agrees_with_the_wire_models_on_types(data: st.DataObject, model: str) -> None:
    """Caps aside, a body passes the check iff the wire model takes it (but for a missing required
    field, which only the model checks): so what the check passes meets no pydantic type error."""
    field = data.draw(st.sampled_from(_fields(model)))
    body = {**REQUIRED.get(model, {}), field: data.draw(JSON)}
    refused = _refusal(body, model, UNCAPPED)
    try:
        MODELS[model].model_validate(body)
        validated = True
    except ValidationError as e:
        validated = False
        if refused is None:  # the check passed it: only a field the model requires may be missing
            assert all(err["type"] == "missing" for err in e.errors()), (body, e.errors())
    if validated:
        assert refused is None, (body, refused)


GENERIC_STRINGS = [
    ("GenerateRequest", ["rid"]),
    ("GenerateRequest", ["cache_salt"]),
    ("GenerateRequest", ["bootstrap_host"]),
    ("CompletionRequest", ["user"]),
    ("CompletionRequest", ["model"]),
    ("ChatCompletionRequest", ["messages", 0, "role"]),
    ("ChatCompletionRequest", ["messages", 0, "name"]),
    ("ChatCompletionRequest", ["messages", 0, "content", 0, "type"]),
    ("AbortRequest", ["rid"]),
]


def _nest(path: list[Any], leaf: Any) -> Any:
    """{"messages": [{"role": leaf}]} from ["messages", 0, "role"]."""
    for key in reversed(path):
        leaf = [leaf] if isinstance(key, int) else {key: leaf}
    return leaf


@FUZZ
@given(where=st.sampled_from(GENERIC_STRINGS), n=st.integers(0, 20))
def test_every_other_string_field_is_capped_by_max_field_size(where: tuple[str, list[Any]], n: int) -> None:
    model, path = where
    body = _nest(path, "x" * n)
    if model == "ChatCompletionRequest" and path[-1] != "role":
        body["messages"][0]["role"] = "user"
    refused = _refusal(body, model)
    if n <= CAPS.max_field_size:
        assert refused is None, refused
        return
    assert refused is not None and refused.param == ".".join(map(str, path)), (path, refused)
    assert f"has {n} characters: at most 8 are allowed (--max-field-size)" in refused.message


@FUZZ
@given(
    texts=st.lists(st.text(max_size=15), min_size=1, max_size=6),
    role=st.text(min_size=1, max_size=8),
    parts=st.integers(0, 20),
)
def test_a_chat_is_capped_in_total(texts: list[str], role: str, parts: int) -> None:
    """What the template prints (roles, names, texts) at most what fits the context in characters;
    content parts at most the context length, over every message."""
    messages = [{"role": role, "content": t} for t in texts]
    messages.append({"role": role, "content": [{"type": "text", "text": ""}] * parts})
    refused = _refusal({"messages": messages}, "ChatCompletionRequest")
    chars = sum(map(len, texts)) + len(role) * len(messages)
    if chars <= MODEL.max_prompt_chars and parts <= MODEL.context_length:  # type: ignore[operator]
        assert refused is None, refused
    else:
        assert refused is not None and refused.param in ("chat_chars", f"messages.{len(texts)}.content"), refused


class CountingWalk:
    """How many values the check looked at one by one (its per-value step, not the tight loop
    over a list of plain scalars)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        check = body_check._Walk.check

        def counting(walk: Any, *args: Any) -> None:
            self.n += 1
            return check(walk, *args)

        monkeypatch.setattr(body_check._Walk, "check", counting)


def _attacks() -> Iterator[tuple[str, str, Any, str]]:
    many = list(range(2_500_000))
    yield "role", "ChatCompletionRequest", {"messages": [{"role": "u" * 20_000_000}]}, "messages.0.role"
    text = {"messages": [{"role": "user", "content": [{"type": "text", "text": many}]}]}
    yield "text part of ints", "ChatCompletionRequest", text, "messages.0.content.0.text"
    yield "messages", "ChatCompletionRequest", {"messages": [{"role": "user"}] * 1_000_000}, "messages"
    yield (
        "parts",
        "ChatCompletionRequest",
        {"messages": [{"role": "u", "content": [{"type": "text"}] * 10**6}]},
        ("messages.0.content"),
    )
    yield "ids then strings", "GenerateRequest", {"input_ids": [1] + ["a"] * 2_500_000}, "input_ids"
    yield "ids then floats", "CompletionRequest", {"prompt": [1] + [1.5] * 2_500_000}, "prompt"
    yield "logit_bias", "ChatCompletionRequest", {"logit_bias": {str(i): 1.0 for i in range(100_000)}}, "logit_bias"
    yield "stop strings", "GenerateRequest", {"sampling_params": {"stop": ["s"] * 10**6}}, "sampling_params.stop"
    yield "prompts", "GenerateRequest", {"text": ["a"] * 10**6}, "text"


@pytest.mark.parametrize("attack", list(_attacks()), ids=lambda a: a[0])
def test_the_attacks_are_refused_after_a_handful_of_steps(
    attack: tuple[str, str, Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model, body, param = attack
    walk = CountingWalk(monkeypatch)
    refused = _refusal(body, model)
    assert refused is not None and refused.param == param, refused
    assert walk.n <= 10, walk.n
    assert len(refused.message) < 300


def test_a_long_list_of_token_ids_is_one_step() -> None:
    """A prompt of ids is checked in the tight loop; the bad entry is named."""
    assert _refusal({"input_ids": list(range(16))}, "GenerateRequest") is None
    refused = _refusal({"input_ids": [*range(9), True]}, "GenerateRequest")
    assert refused is not None and refused.param == "input_ids.9" and "not a boolean" in refused.message
    # a list of booleans: each entry looked at (the loop does not stop at the first good one)
    assert _refusal({"text": ["a", "b"], "return_logprob": [True, False]}, "GenerateRequest") is None
    refused = _refusal({"text": ["a", "b"], "return_logprob": [True, "x"]}, "GenerateRequest")
    assert refused is not None and refused.param == "return_logprob.1"


def test_messages() -> None:
    r = _refusal([1], "GenerateRequest")
    assert r is not None and r.message == "the body must be an object, not a list"
    r = _refusal({"sampling_params": {"max_new_tokens": "8"}}, "GenerateRequest")
    assert r is not None and r.message == "sampling_params.max_new_tokens must be an integer or null, not a string"
    r = _refusal({"text": "x" * 41}, "GenerateRequest")
    assert r is not None and "text has 41 characters: it cannot fit the model's context length of 16" in r.message
    r = _refusal({"input_ids": [[1]] * 5}, "GenerateRequest")  # a batch of token prompts
    assert r is not None and "a request may batch at most 4 prompts (--max-prompts-per-request)" in r.message
