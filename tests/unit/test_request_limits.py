"""The HTTP API's caps (issue 30, finding 4) as properties, without a server: what a request may
hold is refused with a 400 that names the flag exactly when it is past a cap, and prompt text
that cannot fit the context is refused before it is tokenized (hypothesis, bounded and
derandomized like the other fuzz suites)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.config import ConfigError, RequestLimits, ServerConfig
from kvpipe.model.text.tokenizer import Tokenizer
from kvpipe.server.errors import APIError
from kvpipe.server.openai_protocol import COMPLETION_BATCH_FIELDS, ChatCompletionRequest
from kvpipe.server.protocol import (
    GENERATE_BATCH_FIELDS,
    GenerateRequest,
    SamplingParamsIn,
    check_batch_size,
    split_generate_request,
    to_sampling_params,
)
from kvpipe.server.request_caps import apply_limits
from kvpipe.server.validation import (
    PROMPT_CHARS_SLACK,
    ModelLimits,
    longest_token_chars,
    prepare_prompts,
    prompt_chars_cap,
)
from tests.unit.test_protocol import ByteTokenizer

FUZZ = settings(
    max_examples=100, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
CAPS = RequestLimits(
    max_prompts_per_request=4,
    max_stop_strings=3,
    max_stop_string_chars=5,
    max_stop_token_ids=6,
    max_queued_requests=2,
)


@FUZZ
@given(
    stops=st.lists(st.text(min_size=1, max_size=8), max_size=6),
    stop_ids=st.lists(st.integers(0, 1000), max_size=9),
)
def test_stop_caps(stops: list[str], stop_ids: list[int]) -> None:
    sp = SamplingParamsIn(stop=stops, stop_token_ids=stop_ids)
    fits = len(stops) <= 3 and all(len(s) <= 5 for s in stops) and len(stop_ids) <= 6
    if fits:
        p = to_sampling_params(sp, 4, CAPS)
        assert p.stop == tuple(stops) and p.stop_token_ids == tuple(stop_ids)
        return
    with pytest.raises(APIError) as e:
        to_sampling_params(sp, 4, CAPS)
    assert e.value.status == 400 and e.value.param in ("stop", "stop_token_ids")
    assert "(--max-stop-" in e.value.message


def test_a_million_stop_strings_are_refused_by_the_defaults() -> None:
    """The attack of finding 4: 1M stop strings once cost 0.29 s a token on the engine thread."""
    with pytest.raises(APIError, match=r"1000000 stop strings: at most 32 .*--max-stop-strings"):
        to_sampling_params(SamplingParamsIn(stop=["x"] * 1_000_000), 4)
    with pytest.raises(APIError, match="--max-stop-string-chars"):
        to_sampling_params(SamplingParamsIn(stop="y" * 257), 4)
    with pytest.raises(APIError, match="--max-stop-token-ids"):
        to_sampling_params(SamplingParamsIn(stop_token_ids=[1] * 257), 4)


PER_PROMPT = {  # one entry of each /generate and /v1/completions batch field
    "text": "hi",
    "input_ids": [1, 2],
    "sampling_params": {},
    "return_logprob": False,
    "logprob_start_len": 0,
    "top_logprobs_num": 0,
    "rid": "r",
    "bootstrap_host": "h",
    "bootstrap_port": 8998,
    "bootstrap_room": 7,
    "prompt": "hi",
}


@FUZZ
@given(
    field=st.sampled_from(sorted(set(GENERATE_BATCH_FIELDS) | set(COMPLETION_BATCH_FIELDS))),
    n=st.integers(0, 9),
)
def test_batch_size_cap(field: str, n: int) -> None:
    fields = GENERATE_BATCH_FIELDS if field in GENERATE_BATCH_FIELDS else COMPLETION_BATCH_FIELDS
    body = {field: [PER_PROMPT[field]] * n}
    if n <= 4:
        check_batch_size(body, fields, CAPS)
        return
    with pytest.raises(APIError) as e:
        check_batch_size(body, fields, CAPS)
    assert e.value.status == 400 and e.value.param == field and "--max-prompts-per-request" in e.value.message


@pytest.mark.parametrize("field", ["input_ids", "prompt"])
def test_one_long_prompt_of_token_ids_is_not_a_batch(field: str) -> None:
    """A list of ints is one prompt (its length meets the context check, not the batch cap)."""
    check_batch_size({field: list(range(100))}, (field,), CAPS)
    with pytest.raises(APIError, match="--max-prompts-per-request"):
        check_batch_size({field: [[1]] * 5}, (field,), CAPS)


def test_a_million_prompts_are_refused_from_the_raw_json() -> None:
    """The attack of finding 4: a 4.8 MB body of 1M prompts, refused by counting, before the
    wire model walks it; a body that is not an object is left to validation."""
    with pytest.raises(APIError, match=r"text holds 1000000 entries: .* at most 256 prompts"):
        check_batch_size({"text": ["a"] * 1_000_000}, GENERATE_BATCH_FIELDS, RequestLimits())
    check_batch_size(["a"] * 1_000_000, GENERATE_BATCH_FIELDS, RequestLimits())


class ListVocabulary:
    """A real (if tiny) vocabulary: token i is spelled `pieces[i]`."""

    def __init__(self, pieces: list[str | None]) -> None:
        self.pieces = pieces

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def id_to_token(self, i: int) -> str | None:
        return self.pieces[i]


def test_prompt_text_past_the_bound_is_refused_before_tokenizing() -> None:
    assert longest_token_chars(ListVocabulary(["a", None, "<|im_end|>", "bc"])) == 10
    limits = ModelLimits(vocab_size=256, context_length=64, max_prompt_chars=prompt_chars_cap(64, 1))
    assert limits.max_prompt_chars == 64 * PROMPT_CHARS_SLACK
    specs, _ = split_generate_request(GenerateRequest.model_validate({"text": "a" * (limits.max_prompt_chars + 1)}))
    # the token-count check would say "context length is 64"; this refusal counted characters
    with pytest.raises(APIError, match=r"has 257 characters: it cannot fit .* not tokenized"):
        prepare_prompts(specs, ByteTokenizer(), limits)
    specs, _ = split_generate_request(GenerateRequest.model_validate({"text": "a" * limits.max_prompt_chars}))
    with pytest.raises(APIError, match="context length is 64"):  # under the bound: tokenized, then counted
        prepare_prompts(specs, ByteTokenizer(), limits)


@settings(FUZZ, max_examples=60)
@given(text=st.text(min_size=1, max_size=200))
def test_the_character_bound_never_refuses_a_prompt_that_fits(tiny_tokenizer: Tokenizer, text: str) -> None:
    """Sound on a real tokenizer: tokens >= characters / (longest spelling * slack), so text past
    context * longest * slack has more tokens than the context holds."""
    longest = longest_token_chars(tiny_tokenizer)
    assert len(tiny_tokenizer.encode(text, add_special_tokens=False)) * longest * PROMPT_CHARS_SLACK >= len(text)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def test_chat_content_characters() -> None:
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "abc"},
                {"role": "user", "content": [{"type": "text", "text": "de"}, {"type": "image_url"}]},
                {"role": "assistant", "content": None},
            ]
        }
    )
    # what the template prints: roles, string contents and text parts (the image part is refused
    # later by check_supported, before any template)
    assert chat.content_chars() == len("systemabcuserdeassistant")


def test_schema_carries_the_caps() -> None:
    defs = {
        "SamplingParamsIn": SamplingParamsIn.model_json_schema(),
        "GenerateRequest": {"properties": GenerateRequest.model_json_schema()["properties"]},
    }
    apply_limits(defs, CAPS)
    stop = defs["SamplingParamsIn"]["properties"]["stop"]["anyOf"]
    assert stop[0]["maxLength"] == 5 and stop[1]["maxItems"] == 3 and stop[1]["items"]["maxLength"] == 5
    assert defs["SamplingParamsIn"]["properties"]["stop_token_ids"]["anyOf"][0]["maxItems"] == 6
    ids = defs["GenerateRequest"]["properties"]["input_ids"]["anyOf"]
    assert "maxItems" not in ids[0] and ids[1]["maxItems"] == 4  # one prompt of ids / a batch of them
    assert defs["GenerateRequest"]["properties"]["text"]["anyOf"][1]["maxItems"] == 4


def test_limits_config() -> None:
    assert ServerConfig(model_path="m").limits == RequestLimits()
    with pytest.raises(ConfigError, match="max_stop_strings must be a whole number >= 1"):
        RequestLimits(max_stop_strings=0)
    with pytest.raises(ConfigError, match="API key must not be empty"):
        ServerConfig(model_path="m", api_key=" ")
    assert "sekrit" not in repr(ServerConfig(model_path="m", api_key="sekrit-key"))
