"""When a request stops: stop tokens, stop strings, max_new_tokens, context length.

Checked after every token appended to a request, in this order: EOS (unless ignore_eos) and
stop_token_ids (detail: the token id), stop strings in the decoded output (detail: the matched
string), max_new_tokens, context length (both LENGTH). The stop token stays in output_ids; the
text shown to a client ends before a matched stop string, which the server trims using
finish_detail (the engine does not stream text).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpipe.engine.request import FinishReason, Req
from kvpipe.engine.stop_strings import StopStringSearch
from kvpipe.model.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _TextView:
    """One decoding of a request's output and the stop-string search over it."""

    detok: IncrementalDetokenizer
    search: StopStringSearch
    text: str = ""

    def add(self, new_ids: list[int]) -> tuple[int, str] | None:
        self.text += self.detok.add(new_ids)
        hit = self.search.find(self.text)
        if hit is None and (held := self.detok.held()):
            # a token ending inside a UTF-8 character is held back, but the characters before
            # that byte (" " of " " + 0xC2) may already finish a stop string: SGLang decodes the
            # output tail as it is (U+FFFD and all) and stops at this token, so do we
            hit = self.search.find_across(self.text, held)
        return hit


class StopStringMatcher:
    """Finds stop strings in a request's growing output text, decoding only new tokens.

    The output is searched in two views: as a client sees it by default (special tokens
    skipped) and with special tokens as their text (SGLang's rule: its scheduler decodes the
    output tail with them, so stop=["<|endoftext|>"] stops the request). The server's own search
    (request_tracker.py) looks in one of the two, so whatever it finds the engine finds at the
    same token and stops there."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._views = [
            _TextView(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), StopStringSearch(stops))
            for skip in (True, False)
        ]

    def add(self, new_ids: list[int]) -> str | None:
        """Feed new output tokens; return the first stop string that now appears, if any."""
        if not self._stops:
            return None
        hits = [hit for view in self._views if (hit := view.add(new_ids)) is not None]
        return hits[0][1] if hits else None  # the client's default view first


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
