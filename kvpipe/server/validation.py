"""Checks that need the model: tokenisation, vocabulary range, context length.

Kept apart from the wire schemas so both the native and the OpenAI routes (and the PD workers
that come later) turn prompts into `GenerateInput`s the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvpipe.config import RequestLimits
from kvpipe.engine.request import SamplingParams
from kvpipe.server.errors import APIError
from kvpipe.server.protocol import DEFAULT_LIMITS, GenerateInput, PromptSpec, text_options, to_sampling_params

# A token's text is at most as long as the longest spelling in the vocabulary; Unicode
# normalisation (NFC) may merge up to 3 input characters into 1 before that. A prompt longer than
# context * longest spelling * this cannot fit, so it is refused before it is tokenized.
PROMPT_CHARS_SLACK = 4


class TextEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class TokenVocabulary(Protocol):
    @property
    def vocab_size(self) -> int: ...
    def id_to_token(self, i: int) -> str | None: ...


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int  # rows of the embedding: valid ids are [0, vocab_size)
    context_length: int  # prompt + generated tokens must fit
    # prompt text longer than this cannot fit the context (prompt_chars_cap); None: not checked
    max_prompt_chars: int | None = None


def longest_token_chars(vocab: TokenVocabulary) -> int:
    """Characters of the longest token spelling (byte-level BPE spells a byte as one character,
    SentencePiece a space as one, added tokens as their text): no token covers more of a prompt.
    Scans the vocabulary once (~15 ms for 50k tokens): call it off the event loop."""
    longest = 1
    for i in range(vocab.vocab_size):
        piece = vocab.id_to_token(i)
        if piece is not None and len(piece) > longest:
            longest = len(piece)
    return longest


def prompt_chars_cap(context_length: int, token_chars: int) -> int:
    return context_length * token_chars * PROMPT_CHARS_SLACK


def check_prompt_chars(chars: int, limits: ModelLimits) -> None:
    """Refuse text that cannot fit the context before it is tokenized (tokenizing a 32 MiB body
    takes seconds of CPU for nothing)."""
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise APIError(
            f"the prompt has {chars} characters: it cannot fit the model's context length of "
            f"{limits.context_length} tokens (a prompt of more than {limits.max_prompt_chars} "
            "characters is not tokenized)",
            param="prompt",
        )


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "input_ids") -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"{what} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}", param=what)


def check_fits_context(prompt_len: int, max_new_tokens: int, context_length: int) -> None:
    if prompt_len == 0:
        raise APIError("the prompt is empty", param="prompt")
    if prompt_len >= context_length:
        raise APIError(
            f"the prompt has {prompt_len} tokens; the model's context length is {context_length}", param="prompt"
        )
    if prompt_len + max_new_tokens > context_length:
        raise APIError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {prompt_len + max_new_tokens} tokens: {prompt_len} tokens from the "
            f"input and {max_new_tokens} tokens for the completion.",
            param="max_new_tokens",
        )


def finalize_input(
    rid: str, ids: list[int], params: SamplingParams, limits: ModelLimits, **kw: object
) -> GenerateInput:
    """Range-check the ids and the length, then freeze one engine-ready prompt."""
    check_token_ids(ids, limits.vocab_size)
    check_token_ids(params.stop_token_ids, limits.vocab_size, "stop_token_ids")
    check_fits_context(len(ids), params.max_new_tokens, limits.context_length)
    return GenerateInput(rid=rid, input_ids=tuple(ids), params=params, **kw)  # type: ignore[arg-type]


def prepare_prompts(
    specs: list[PromptSpec],
    tokenizer: TextEncoder,
    limits: ModelLimits,
    default_max_new_tokens: int = 128,
    request_limits: RequestLimits = DEFAULT_LIMITS,
) -> list[GenerateInput]:
    """`/generate` prompt specs -> validated inputs (text is tokenised with special tokens, as
    SGLang). Tokenizes: the server runs it in a worker thread, not on the event loop."""
    out = []
    for i, spec in enumerate(specs):
        params = to_sampling_params(spec.sampling, default_max_new_tokens, request_limits)
        if spec.text is not None:
            if spec.text == "":
                raise APIError("the prompt text is empty", param="text")
            check_prompt_chars(len(spec.text), limits)
            ids = tokenizer.encode(spec.text)
        else:
            ids = list(spec.input_ids or [])
        if spec.sampling.max_new_tokens is None:  # a default, not a request: clamp it to the context
            params = replace(
                params, max_new_tokens=max(1, min(params.max_new_tokens, limits.context_length - len(ids)))
            )
        out.append(
            finalize_input(
                spec.rid,
                ids,
                params,
                limits,
                return_logprob=spec.return_logprob,
                text_options=text_options(spec.sampling),
                bootstrap=spec.bootstrap,
                index=i,
            )
        )
    return out


def with_default_max_tokens(params: SamplingParams, prompt_len: int, limits: ModelLimits) -> SamplingParams:
    """OpenAI chat without max_tokens: generate up to the end of the context."""
    return replace(params, max_new_tokens=max(1, limits.context_length - prompt_len))
