"""Request schemas, sampling-parameter checks and prompt validation (no server, no model)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpipe.server.errors import APIError
from kvpipe.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvpipe.server.protocol import (
    BootstrapInfo,
    GenerateRequest,
    SamplingParamsIn,
    split_generate_request,
    text_options,
    to_sampling_params,
)
from kvpipe.server.validation import ModelLimits, check_fits_context, check_token_ids, prepare_prompts


class ByteTokenizer:
    """A real (if trivial) encoder: one token per UTF-8 byte."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


LIMITS = ModelLimits(vocab_size=256, context_length=64)


def _split(body: dict) -> tuple[list, bool]:
    return split_generate_request(GenerateRequest.model_validate(body))


def test_single_and_batched_prompts() -> None:
    specs, batched = _split({"text": "hi", "rid": "r1"})
    assert not batched and len(specs) == 1 and specs[0].rid == "r1" and specs[0].text == "hi"
    specs, batched = _split({"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 2}, {}]})
    assert batched and [s.input_ids for s in specs] == [[1, 2], [3]]
    assert specs[0].sampling.max_new_tokens == 2 and specs[1].sampling.max_new_tokens is None
    assert specs[0].rid != specs[1].rid  # generated rids are unique
    specs, batched = _split({"input_ids": [5, 6, 7]})
    assert not batched and specs[0].input_ids == [5, 6, 7]


def test_bootstrap_fields_carried_per_prompt() -> None:
    specs, _ = _split(
        {"text": ["a", "b"], "bootstrap_host": ["h1", "h2"], "bootstrap_port": None, "bootstrap_room": [11, 12]}
    )
    assert [s.bootstrap for s in specs] == [BootstrapInfo("h1", None, 11), BootstrapInfo("h2", None, 12)]
    specs, _ = _split({"text": "a", "bootstrap_host": "h", "bootstrap_port": 8998, "bootstrap_room": 2**62})
    assert specs[0].bootstrap == BootstrapInfo("h", 8998, 2**62)
    specs, _ = _split({"text": "a"})
    assert specs[0].bootstrap is None
    inputs = prepare_prompts(_split({"text": "ab", "bootstrap_room": 7})[0], ByteTokenizer(), LIMITS)
    assert inputs[0].bootstrap == BootstrapInfo(None, None, 7) and inputs[0].input_ids == (97, 98)


@pytest.mark.parametrize(
    "body",
    [
        {"text": "a", "input_ids": [1]},
        {},
        {"text": []},
        {"text": ["a", "b"], "rid": ["x"]},
        {"text": ["a", "b"], "rid": ["x", "x"]},
        {"text": "a", "rid": ["x"]},
        {"text": ["a", "b"], "sampling_params": [{}]},
        {"text": ["a", "b"], "bootstrap_room": [1, 2, 3]},
        {"text": "a", "top_logprobs_num": 3},
    ],
)
def test_bad_shapes(body: dict) -> None:
    with pytest.raises(APIError) as e:
        _split(body)
    assert e.value.status == 400


@pytest.mark.parametrize(
    "body",
    [
        {"text": 3},
        {"input_ids": "abc"},
        {"input_ids": [1, "2"]},
        {"input_ids": [1, 2.5]},
        {"text": "a", "stream": "yes"},
        {"text": "a", "sampling_params": {"temperature": "hot"}},
        {"text": "a", "sampling_params": {"max_new_tokens": 1.0}},
        {"text": "a", "sampling_params": {"ignore_eos": 1}},
    ],
)
def test_wrong_types_rejected_not_coerced(body: dict) -> None:
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate(body)


def test_unknown_fields_ignored_and_nulls_default() -> None:
    req = GenerateRequest.model_validate(
        {
            "text": "a",
            "return_hidden_states": False,
            "sampling_params": {"max_new_tokens": None, "temperature": None, "stop": None, "json_schema": None},
        }
    )
    p = to_sampling_params(req.sampling_params, 128)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (128, 1.0, 1.0, -1, ())


def test_sampling_params_mapping() -> None:
    sp = SamplingParamsIn(
        max_new_tokens=5,
        temperature=0,
        top_p=0.5,
        top_k=3,
        min_p=0.1,
        stop="x",
        stop_token_ids=[4],
        ignore_eos=True,
        seed=9,
        no_stop_trim=True,
        skip_special_tokens=False,
    )
    p = to_sampling_params(sp, 128)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (5, 0.0, 0.5, 3, 0.1)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.seed, p.greedy) == (("x",), (4,), True, 9, True)
    t = text_options(sp)
    assert t.no_stop_trim and not t.skip_special_tokens
    assert to_sampling_params(SamplingParamsIn(top_k=0), 1).top_k == -1  # 0 means "no limit" too


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
        ({"n": 3}, "n"),
        ({"frequency_penalty": 0.3}, "frequency_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ],
)
def test_sampling_params_out_of_range(kw: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        to_sampling_params(SamplingParamsIn(**kw), 16)
    assert e.value.status == 400 and e.value.param == param


def test_context_and_vocab_checks() -> None:
    check_fits_context(10, 54, 64)  # exactly fits
    with pytest.raises(APIError, match="maximum context length of 64"):
        check_fits_context(10, 55, 64)
    with pytest.raises(APIError, match="empty"):
        check_fits_context(0, 1, 64)
    with pytest.raises(APIError, match="context length is 64"):
        check_fits_context(64, 1, 64)
    check_token_ids([0, 255], 256)
    with pytest.raises(APIError, match=r"\[256, -1\]"):
        check_token_ids([1, 256, -1], 256)
    with pytest.raises(APIError, match="empty"):
        prepare_prompts(_split({"text": ""})[0], ByteTokenizer(), LIMITS)
    with pytest.raises(APIError, match="stop_token_ids"):
        prepare_prompts(_split({"text": "a", "sampling_params": {"stop_token_ids": [300]}})[0], ByteTokenizer(), LIMITS)
    with pytest.raises(APIError, match="context length"):
        prepare_prompts(
            _split({"text": "a" * 60, "sampling_params": {"max_new_tokens": 16}})[0], ByteTokenizer(), LIMITS
        )
    # an unrequested default shrinks to the room left in the context instead of failing
    inp = prepare_prompts(_split({"text": "a" * 60})[0], ByteTokenizer(), LIMITS, default_max_new_tokens=16)[0]
    assert inp.params.max_new_tokens == 4


def test_openai_schemas() -> None:
    c = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": [1, 2],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "unknown_field": 1,
        }
    )
    assert c.prompts() == [[1, 2]] and c.include_usage() and c.bootstrap() is None
    b = CompletionRequest.model_validate(
        {"prompt": ["a", "b"], "bootstrap_host": ["h", "h"], "bootstrap_port": None, "bootstrap_room": [1, 2]}
    )
    assert [b.bootstrap(i, 2) for i in range(2)] == [BootstrapInfo("h", None, 1), BootstrapInfo("h", None, 2)]
    with pytest.raises(APIError):
        b.bootstrap(0, 3)
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert not CompletionRequest.model_validate(
        {"prompt": "a", "stream_options": {"include_usage": True}}
    ).include_usage()  # only with stream
    with pytest.raises(APIError):
        CompletionRequest.model_validate({"prompt": "a", "echo": True}).check_supported()
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
        }
    )
    assert chat.max_new_tokens() == 7  # the router's rewrite wins over the legacy field
    assert chat.message_dicts() == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(APIError, match="tool"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}
        ).check_supported()
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 5}]})
    sp = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "n": 2}).sampling(4)
    with pytest.raises(APIError, match="n=1"):
        to_sampling_params(sp, 4)
