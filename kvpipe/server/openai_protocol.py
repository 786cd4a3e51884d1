"""OpenAI-compatible request schemas and their mapping onto kvpipe's sampling parameters.

Fields OpenAI defines that kvpipe cannot honour are refused with a 400 when set to a
non-default value (never silently ignored); unknown fields are ignored, because sglang-router
rebuilds bodies with fields of its own. SGLang's extensions (top_k, min_p, stop_token_ids,
ignore_eos, rid, bootstrap_*) are accepted as SGLang does.
"""

from __future__ import annotations

from typing import Any

from kvpipe.server.errors import APIError
from kvpipe.server.protocol import BootstrapInfo, SamplingParamsIn, WireModel, pick

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# /v1/completions fields that hold one entry per prompt when they are lists
COMPLETION_BATCH_FIELDS = ("prompt", "bootstrap_host", "bootstrap_port", "bootstrap_room")


class StreamOptions(WireModel):
    include_usage: bool | None = False


class _OpenAIBase(WireModel):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    repetition_penalty: float | None = None
    rid: str | None = None
    cache_salt: str | None = None  # vLLM's: prefixes are shared only with requests of the same salt
    return_meta_info: bool | None = False  # SGLang's: each choice carries /generate's meta_info (not streamed)
    # PD fields injected by sglang-router (lists for a batched prompt)
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def bootstrap(self, i: int = 0, n: int = 1) -> BootstrapInfo | None:
        """The PD bootstrap fields of prompt i of n."""
        info = BootstrapInfo(
            pick(self.bootstrap_host, i, n, "bootstrap_host"),
            pick(self.bootstrap_port, i, n, "bootstrap_port"),
            pick(self.bootstrap_room, i, n, "bootstrap_room"),
        )
        return None if info == BootstrapInfo() else info

    def sampling(self, max_tokens: int | None) -> SamplingParamsIn:
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        return SamplingParamsIn(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            n=self.n,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
        )


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("the prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def check_supported(self) -> None:
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError("best_of must be 1", param="best_of")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.logprobs not in (None, 0):
            raise APIError("only logprobs=0 (logprobs of the sampled tokens) is supported", param="logprobs")


class ContentPart(WireModel):
    """One part of a message's content: only `{"type": "text", "text": ...}` is served (others
    are refused by `check_supported`, before any template); fields of other kinds are ignored."""

    type: str
    text: str | None = None


class ChatMessage(WireModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def max_new_tokens(self) -> int | None:
        # sglang-router turns max_tokens into max_completion_tokens; OpenAI deprecates max_tokens.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        if self.tools:
            raise APIError("tool calling is not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError('only response_format {"type": "text"} is supported', param="response_format")
        if self.top_logprobs not in (None, 0):
            raise APIError("top_logprobs is not supported (only the sampled tokens' logprobs)", param="top_logprobs")
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.type != "text":
                    raise APIError(
                        f"messages.{i}.content.{j}: content parts of type {part.type!r} are not supported, only text",
                        param=f"messages.{i}.content.{j}.type",
                    )

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def content_chars(self) -> int:
        """Characters of what the chat template prints of the messages (roles, names, string
        contents and text parts): the template only adds to them, so this bounds the prompt from
        below before it is rendered."""
        total = 0
        for m in self.messages:
            total += len(m.role) + len(m.name or "")
            if isinstance(m.content, str):
                total += len(m.content)
            elif m.content is not None:
                total += sum(len(p.text or "") for p in m.content)
        return total
