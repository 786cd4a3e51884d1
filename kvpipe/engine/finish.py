"""When a request stops: stop tokens, stop strings, max_new_tokens, context length.

Checked after every token appended to a request, in this order: EOS (unless ignore_eos) and
stop_token_ids (detail: the token id), stop strings in the decoded output (detail: the matched
string), max_new_tokens, context length (both LENGTH). The stop token stays in output_ids; the
text shown to a client ends before a matched stop string, which the server trims using
finish_detail (the engine does not stream text).
"""

from __future__ import annotations

from kvpipe.engine.request import FinishReason, Req
from kvpipe.engine.stop_strings import StopStringSearch
from kvpipe.model.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringMatcher:
    """Finds stop strings in a request's growing output text, decoding only new tokens.

    Special tokens are decoded as their text (SGLang's rule: its scheduler decodes the output
    tail with them), so a stop string naming one, "<|endoftext|>" or "<|im_start|>", stops
    the request whether or not its client asked to see special tokens."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._search = StopStringSearch(stops)
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        self._text = ""

    def add(self, new_ids: list[int]) -> str | None:
        """Feed new output tokens; return the first stop string that now appears, if any."""
        if not self._search.stops:
            return None
        self._text += self._detok.add(new_ids)
        hit = self._search.find(self._text)
        return None if hit is None else hit[1]


class FinishChecker:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self._matchers: dict[str, StopStringMatcher] = {}

    def check(self, req: Req, num_new: int) -> tuple[FinishReason, str | int | None] | None:
        """Call after `num_new` tokens were appended to req.output_ids (0 after a prefill that
        produced no token). Returns (reason, detail) if the request is done."""
        p = req.params
        if num_new > 0:
            last = req.output_ids[-1]
            eos = req.eos_token_ids or self.eos_token_ids
            if (not p.ignore_eos and last in eos) or last in p.stop_token_ids:
                return FinishReason.STOP, last
            if p.stop:
                m = self._matchers.get(req.rid)
                if m is None:
                    m = self._matchers[req.rid] = StopStringMatcher(self.tokenizer, p.stop)
                    hit = m.add(req.output_ids)
                else:
                    hit = m.add(req.output_ids[-num_new:])
                if hit is not None:
                    return FinishReason.STOP, hit
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason.LENGTH, len(req.output_ids)
        if req.seq_len >= self.context_length:
            return FinishReason.LENGTH, len(req.output_ids)
        return None

    def forget(self, rid: str) -> None:
        self._matchers.pop(rid, None)
