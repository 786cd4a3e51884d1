"""Finding stop strings in a growing text: one search for the engine and the server.

The engine looks for them in its own decode of the output to stop generating; the server looks
again in the text it shows (after the stop token is left out) to trim it, and holds back a tail
that may still become a stop string while streaming. Both ask this class.
"""

from __future__ import annotations


class StopStringSearch:
    """The earliest stop string in a text that only grows between calls (plain Python, no tokens).

    `find` resumes where the previous call ended: it looks back only `longest - 1` characters,
    enough for a match that straddles the old end, so a long output is not searched again and
    again. Empty stop strings are ignored (they would match everywhere).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._searched = 0  # text[:_searched] was searched and held no complete stop string

    def find(self, text: str) -> tuple[int, str] | None:
        """(position, stop string) of the earliest match in `text`, the longer text of the last
        call plus what was appended since; at one position the shorter stop string
        (a prefix of the other) wins."""
        if not self.stops:
            return None
        start = max(0, self._searched - self._longest + 1)
        hits = [(pos, s) for s in self.stops if (pos := text.find(s, start)) >= 0]
        self._searched = len(text)
        return min(hits) if hits else None

    def find_across(self, text: str, tail: str) -> tuple[int, str] | None:
        """Like `find` on `text + tail`, for a tail that may still change (a detokenizer's held
        text): only matches that reach into `tail` are new, and the search does not advance."""
        head = text[max(0, len(text) - self._longest + 1) :]
        joined = head + tail
        hits = [(pos, s) for s in self.stops if (pos := joined.find(s)) >= 0]
        if not hits:
            return None
        pos, s = min(hits)
        return len(text) - len(head) + pos, s

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string: what a
        stream must not show yet, since the next tokens may complete the stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
