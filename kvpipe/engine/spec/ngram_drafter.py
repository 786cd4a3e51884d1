"""NGRAM drafting (prompt lookup): propose what followed the request's own latest n-gram before.

No draft model: the request's tokens (prompt + output) are searched for the longest suffix of at
most `max_window` tokens (and at least `min_window`) that occurred earlier; the tokens that
followed its most recent earlier occurrence are the draft. When the copy reaches the end of the
sequence it goes on with what it just copied, so a sequence that repeats with period p gets a
full draft of that period (a run of "a b a b" drafts "a b a b ..."), not p tokens only.

Pure bookkeeping over token ids (numpy for the search); the engine verifies what this proposes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.request import Req
from kvpipe.engine.spec.drafter import Drafter


def longest_suffix_match(tokens: np.ndarray, min_window: int, max_window: int) -> tuple[int, int]:
    """(n, end): the longest n in [min_window, max_window] such that tokens[-n:] also ends at an
    earlier index `end` (tokens[end - n + 1 : end + 1] == tokens[-n:], end < len - 1), the most
    recent such end; (0, -1) when no suffix of min_window tokens occurred before."""
    size = int(tokens.size)
    if size < 2 or min_window > size - 1:
        return 0, -1
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # earlier positions matching the last token
    n = 1
    limit = min(max_window, size - 1)  # a match of n needs n tokens before the end, inside
    while ends.size and n < limit:
        ends_ok = ends[ends - n >= 0]
        hit = ends_ok[tokens[ends_ok - n] == tokens[size - 1 - n]]
        if hit.size == 0:
            break
        ends, n = hit, n + 1
    if ends.size == 0 or n < min_window:
        return 0, -1
    return n, int(ends[-1])


def propose_ngram(tokens: Sequence[int], max_draft: int, min_window: int = 1, max_window: int = 12) -> list[int]:
    """Up to `max_draft` draft tokens for a request whose tokens so far are `tokens`."""
    if max_draft <= 0 or len(tokens) < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    n, end = longest_suffix_match(arr, min_window, max_window)
    if n == 0:
        return []
    seq = list(tokens)
    size = len(seq)
    draft: list[int] = []
    # seq[end + 1 + i] continues the match; past the end it is the draft itself (period size - end - 1)
    for i in range(max_draft):
        j = end + 1 + i
        draft.append(seq[j] if j < size else draft[j - size])
    return draft


class NgramDrafter(Drafter):
    """NGRAM as the engine's drafter: no draft KV, nothing to keep or move (PD: the decode drafts
    from the request's own tokens)."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.min_window = spec.ngram_min_match_window_size
        self.max_window = spec.ngram_max_match_window_size

    def propose(self, req: Req, max_drafts: int) -> list[int]:
        return propose_ngram(req.all_ids, max_drafts, self.min_window, self.max_window)
