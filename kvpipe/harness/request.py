"""What the load driver sends: one request as data (which API, the prompt, the output length, whether
it streams, when it is released) and its JSON body.

Three APIs: SGLang's native `/generate` (a token-id or a text prompt), OpenAI `/v1/completions` and
`/v1/chat/completions`. Output lengths are exact (`ignore_eos`) and sampling greedy, so a request
that ends with a different token count ended wrong.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class Api(enum.Enum):
    GENERATE = "generate"  # SGLang native /generate
    COMPLETION = "completion"  # /v1/completions
    CHAT = "chat"  # /v1/chat/completions

    @property
    def path(self) -> str:
        return _PATHS[self]


_PATHS = {Api.GENERATE: "/generate", Api.COMPLETION: "/v1/completions", Api.CHAT: "/v1/chat/completions"}

Prompt = tuple[int, ...] | str  # token ids, or text


@dataclass(frozen=True)
class Request:
    index: int  # its place in the run (the driver returns outcomes in this order)
    prompt: Prompt
    max_tokens: int  # exact: ignore_eos
    api: Api = Api.GENERATE
    stream: bool = True
    arrival_s: float = 0.0  # offset from the start of the run at which it is released
    # multi-turn (token-id prompts): the index of the previous turn; `prompt` then holds only this
    # turn's new tokens, and what is sent is the previous prompt + its output ids + these
    follows: int | None = None
    disconnect_after: int | None = None  # close the stream after this many events (None: read to the end)

    @property
    def prompt_len(self) -> int:
        """Tokens of a token-id prompt, characters of a text one (a follow-up: its new tokens)."""
        return len(self.prompt)

    def body(self, model: str = "", prompt: Sequence[int] | str | None = None) -> dict[str, Any]:
        """The JSON body for `api.path`; `prompt` replaces the request's own (a follow-up's whole
        conversation); `model` names the model for the OpenAI APIs ("" sends none)."""
        p = self.prompt if prompt is None else prompt
        sent: list[int] | str = p if isinstance(p, str) else list(p)
        if self.api is Api.GENERATE:
            return {
                "text" if isinstance(sent, str) else "input_ids": sent,
                "stream": self.stream,
                "sampling_params": {"max_new_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True},
            }
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": self.stream,
        }
        if model:  # no name: the server's own model (a wrong name is refused with 404)
            body["model"] = model
        if self.stream:  # the last chunk then reports the token count
            body["stream_options"] = {"include_usage": True}
        if self.api is Api.CHAT:
            if not isinstance(sent, str):
                raise ValueError(f"request {self.index}: a chat request needs a text prompt")
            body["messages"] = [{"role": "user", "content": sent}]
        else:
            body["prompt"] = sent
        return body
