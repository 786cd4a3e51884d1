"""StopStringSearch: the one stop-string search of the engine (finish.py) and the server
(request_tracker.py): straddling matches, several stops, resuming, hold-back."""

from __future__ import annotations

import random

from kvpipe.engine.stop_strings import StopStringSearch


def _first_hit(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Reference: the earliest stop string in the whole text."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits) if hits else None


def test_match_straddling_the_previous_end() -> None:
    search = StopStringSearch(("world",))
    assert search.find("hello wo") is None
    assert search.find("hello world!") == (6, "world")


def test_match_completed_one_character_at_a_time() -> None:
    text, search = "xxabcabd", StopStringSearch(("abd",))
    hits = [search.find(text[:i]) for i in range(1, len(text) + 1)]
    assert hits == [None] * (len(text) - 1) + [(5, "abd")]


def test_several_stops_earliest_position_wins() -> None:
    assert StopStringSearch(("beta", "alpha")).find("-- alpha beta") == (3, "alpha")
    assert StopStringSearch(("alpha", "beta")).find("-- beta alpha") == (3, "beta")
    # two stops complete in one call: the earlier position, not the one listed first
    search = StopStringSearch(("END", "<|x|>"))
    assert search.find("ab<|x") is None
    assert search.find("ab<|x|>END") == (2, "<|x|>")


def test_same_position_the_shorter_stop_wins() -> None:
    assert StopStringSearch(("abc", "ab")).find("zabc") == (1, "ab")


def test_no_stops_and_empty_stops_never_match() -> None:
    assert StopStringSearch(()).find("anything") is None
    search = StopStringSearch(("", "STOP"))
    assert search.stops == ("STOP",)
    assert search.find("no match here") is None and search.find("no match here STOP") == (14, "STOP")


class _RecordingStr(str):
    """A str that records where `find` was asked to start."""

    starts: list[int]

    def find(self, sub: str, start: int | None = None, *args: int) -> int:  # type: ignore[override]
        self.starts.append(0 if start is None else start)
        return super().find(sub, start, *args)


def test_resumes_where_the_last_search_ended() -> None:
    search = StopStringSearch(("STOP", "ab"))
    first = _RecordingStr("x" * 100)
    first.starts = []
    assert search.find(first) is None and first.starts == [0, 0]
    longer = _RecordingStr("x" * 150)
    longer.starts = []
    assert search.find(longer) is None
    assert longer.starts == [97, 97]  # 100 searched, look back len("STOP") - 1 for a straddling match


def test_incremental_equals_a_full_search() -> None:
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 40)))
        stops = tuple("".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3)))
        search, end, hit = StopStringSearch(stops), 0, None
        while hit is None and end < len(text):
            end = min(len(text), end + rng.randint(1, 5))
            hit = search.find(text[:end])
            if hit is None:
                assert _first_hit(text[:end], stops) is None, (text[:end], stops)
        assert hit == _first_hit(text[:end], stops), (text[:end], stops)


def test_holdback() -> None:
    assert StopStringSearch(("world",)).holdback("hello wor") == 3
    assert StopStringSearch(("world",)).holdback("hello") == 0
    assert StopStringSearch(("abd", "bc")).holdback("abcab") == 2  # "ab" may still become "abd"
    assert StopStringSearch(()).holdback("x") == 0
    assert StopStringSearch(("world",)).holdback("hello world") == 0  # a whole match is find's job
    assert StopStringSearch(("abcd",)).holdback("ab") == 2  # the text is shorter than the stop
