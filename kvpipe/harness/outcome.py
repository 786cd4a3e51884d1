"""How one request ended, and when: the one record the load driver returns for every request
(`kvpipe bench serve` measures latency from it, the soak and the kill -9 campaign judge it).

Times are readings of the driver's clock (seconds). Token events are the stream events that
brought new output tokens: their arrival times and the cumulative token count at each.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpipe.harness.request import Request


class End(enum.Enum):
    OK = "ok"  # a normal finish with every token asked for
    HTTP_ERROR = "http_error"  # a non-200 answer: `http_status`, `body`
    ABORT = "abort"  # the server ended it: an error body or event, or finish_reason abort
    CUT = "cut"  # it ended wrong: no [DONE], no finish reason, another token count, a malformed answer
    CONNECTION = "connection_error"  # the connection broke or was refused
    DISCONNECTED = "disconnected"  # we closed the stream on purpose (Request.disconnect_after)
    TIMEOUT = "timeout"  # no final status within the deadline: a hang
    NOT_SENT = "not_sent"  # the turn it follows failed, so it was never sent


@dataclass(frozen=True)
class Outcome:
    request: Request
    end: End
    start_s: float  # sent (a request never sent: when it was given up)
    end_s: float  # its final status
    prompt_len: int  # what was sent: tokens, or a text prompt's characters (a follow-up: the whole conversation)
    http_status: int | None = None  # None: no response
    body: str = ""  # an HTTP error's body (at most 300 characters)
    message: str = ""  # the server's own error message ("" when it gave none)
    reason: str = ""  # how it ended, for people ("" when OK)
    token_times: tuple[float, ...] = ()  # events that brought new tokens
    token_counts: tuple[int, ...] = ()  # cumulative output tokens at each
    output_ids: tuple[int, ...] = ()  # the final cumulative output ids (native API)
    cached_tokens: int | None = None  # meta_info.cached_tokens of the last event (None: not reported)
    events: int = 0  # stream events received (a plain answer: 1)
    # the prompt's tokens as the server counted them (a chat: rendered with its template); None: not reported
    server_prompt_tokens: int | None = None

    @property
    def index(self) -> int:
        return self.request.index

    @property
    def ok(self) -> bool:
        return self.end is End.OK

    @property
    def prompt_tokens(self) -> int | None:
        """Prompt tokens: the server's count, else the length of a token-id prompt; None for a
        text prompt the server gave no count for (its characters are no token count)."""
        if self.server_prompt_tokens is not None:
            return self.server_prompt_tokens
        return None if isinstance(self.request.prompt, str) else self.prompt_len

    @property
    def output_tokens(self) -> int:
        return self.token_counts[-1] if self.token_counts else 0

    @property
    def latency_s(self) -> float | None:
        """Send to final status; None for a request never sent."""
        return None if self.end is End.NOT_SENT else self.end_s - self.start_s
