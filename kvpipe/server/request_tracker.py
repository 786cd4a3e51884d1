"""Per-request output bookkeeping on the server side (plain Python, no threads, no I/O).

Turns the engine's `TokenOutput`s into cumulative `RequestOutput`s: incremental detokenisation,
stop strings (matched in the text, trimmed, and text that may still become a stop string held
back while streaming so a client never sees text that is later taken away), the stop token left
out of the text, logprobs, latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvpipe.engine.request import FinishReason, TokenOutput, finish_reason_json
from kvpipe.engine.spec.verify import SpecCounts
from kvpipe.engine.stop_strings import StopStringSearch
from kvpipe.engine.timeline import TimelineRecord
from kvpipe.server.protocol import GenerateInput


class Detokenizer(Protocol):
    def add(self, new_ids: list[int]) -> str: ...
    def flush(self) -> str: ...


@dataclass(frozen=True)
class RequestOutput:
    """What a client may see of one request after an engine step (cumulative, like SGLang)."""

    rid: str
    index: int  # position in a batched request
    text: str
    delta_text: str  # text added since the previous RequestOutput
    output_ids: list[int]
    num_new_ids: int  # output_ids[-num_new_ids:] arrived with this output
    output_logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int
    e2e_latency: float
    finish_reason: FinishReason | None = None
    finish_detail: str | int | None = None
    spec: SpecCounts | None = None  # a speculative engine's counts, once the request finished
    timeline: TimelineRecord | None = None  # the engine's, once it finished the request

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def finish_reason_json(self) -> dict[str, Any] | None:
        return finish_reason_json(self.finish_reason, self.finish_detail, self.completion_tokens)

    def meta_info(self) -> dict[str, Any]:
        """SGLang's `meta_info` of the request so far: /generate's (and, with `return_meta_info`,
        an OpenAI choice's); a speculative engine's counts (spec_accept_length, ...) once it finished."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason_json(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(self.e2e_latency, 6),
        }
        if self.spec is not None and self.finished:  # SGLang reports these when a request finished
            meta.update(self.spec.meta_info())
        return meta


class RequestTracker:
    def __init__(self, inp: GenerateInput, detok: Detokenizer, start_time: float) -> None:
        self.inp = inp
        self.detok = detok
        self.start_time = start_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None  # when output tokens last arrived (inter-token latency)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.prompt_tokens = len(inp.input_ids)
        self.cached_tokens = 0
        self._text = ""  # all decoded text, untrimmed
        self._stops = StopStringSearch(inp.params.stop)
        self._emitted = 0  # characters of text already handed out
        self.finish_reason: FinishReason | None = None
        self.finish_detail: str | int | None = None
        # Set when a stop string matched here but the engine still runs the request: abort it there.
        self.needs_engine_abort = False
        self.spec: SpecCounts | None = None
        self.timeline: TimelineRecord | None = None  # the engine's, with its final output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, outs: list[TokenOutput], now: float) -> RequestOutput | None:
        """Fold engine outputs in; None when nothing visible changed."""
        if self.finished:
            return None
        n_before = len(self.output_ids)
        engine_finish: TokenOutput | None = None
        for out in outs:
            ids = list(out.token_ids)
            self.output_ids += ids
            self.logprobs += list(out.logprobs)
            self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
            self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
            self.spec = out.spec or self.spec
            if out.finish_reason is not None:
                engine_finish = out
                self.timeline = out.timeline
                # A matched stop token / EOS stays in output_ids but not in the text (as SGLang).
                if (
                    out.finish_reason is FinishReason.STOP
                    and isinstance(out.finish_detail, int)
                    and ids
                    and ids[-1] == out.finish_detail
                    and not self.inp.text_options.no_stop_trim
                ):
                    ids = ids[:-1]
            self._text += self.detok.add(ids)
            if engine_finish is not None:
                break  # nothing follows a finish
        if self.output_ids and self.first_token_time is None:
            self.first_token_time = now
        if len(self.output_ids) > n_before:
            self.last_token_time = now
        if engine_finish is not None:
            self._text += self.detok.flush()
        visible_end = len(self._text)
        hit = self._stops.find(self._text)
        if hit is not None:
            pos, s = hit
            visible_end = pos + (len(s) if self.inp.text_options.no_stop_trim else 0)
            self.finish_reason, self.finish_detail = FinishReason.STOP, s
            self.needs_engine_abort = engine_finish is None
        elif engine_finish is not None:
            self.finish_reason, self.finish_detail = engine_finish.finish_reason, engine_finish.finish_detail
        else:
            visible_end -= self._stops.holdback(self._text)
        visible_end = max(visible_end, self._emitted)
        delta = self._text[self._emitted : visible_end]
        self._emitted = visible_end
        if not delta and len(self.output_ids) == n_before and not self.finished:
            return None
        return self._snapshot(delta, len(self.output_ids) - n_before, now)

    def finish_abort(self, message: str, now: float) -> RequestOutput:
        """End the request here (engine failure, client gone) with what was produced so far."""
        if not self.finished:
            self.finish_reason, self.finish_detail = FinishReason.ABORT, message
        return self._snapshot("", 0, now)

    def _snapshot(self, delta: str, num_new: int, now: float) -> RequestOutput:
        return RequestOutput(
            rid=self.inp.rid,
            index=self.inp.index,
            text=self._text[: self._emitted],
            delta_text=delta,
            output_ids=list(self.output_ids),
            num_new_ids=num_new,
            output_logprobs=list(self.logprobs),
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            e2e_latency=now - self.start_time,
            finish_reason=self.finish_reason,
            finish_detail=self.finish_detail,
            spec=self.spec,
            timeline=self.timeline,
        )
