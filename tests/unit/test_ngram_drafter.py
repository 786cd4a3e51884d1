"""NGRAM drafting: the longest earlier occurrence of the request's own suffix, and what followed it."""

import numpy as np
import pytest

from kvpipe.engine.spec.ngram_drafter import longest_suffix_match, propose_ngram


def test_proposes_what_followed_the_suffix():
    # "3 4" occurred before, followed by 5 6 7
    assert propose_ngram([1, 2, 3, 4, 5, 6, 7, 9, 3, 4], 3) == [5, 6, 7]
    assert propose_ngram([1, 2, 3, 4, 5, 6, 7, 9, 3, 4], 2) == [5, 6]


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # suffix "1 2 3": the long match is at the start (followed by 10); "2 3" alone last occurred
    # followed by 20, "3" alone followed by 30
    toks = [1, 2, 3, 10, 7, 2, 3, 20, 8, 3, 30, 1, 2, 3]
    n, end = longest_suffix_match(np.asarray(toks), 1, 12)
    assert (n, end) == (3, 2)
    assert propose_ngram(toks, 1) == [10]
    assert propose_ngram(toks, 1, max_window=2) == [20]  # only windows up to 2: "2 3" -> 20
    assert propose_ngram(toks, 1, max_window=1) == [30]


def test_the_most_recent_of_equally_long_matches_wins():
    assert propose_ngram([5, 6, 1, 5, 6, 2, 5, 6], 1) == [2]


def test_min_window_refuses_short_matches():
    toks = [1, 2, 3, 9, 3]  # only "3" matches
    assert propose_ngram(toks, 2) == [9, 3]
    assert propose_ngram(toks, 2, min_window=2) == []


def test_nothing_to_propose():
    assert propose_ngram([1, 2, 3, 4], 4) == []  # the last token never occurred before
    assert propose_ngram([7], 4) == []
    assert propose_ngram([], 4) == []
    assert propose_ngram([1, 2, 1], 0) == []


def test_a_periodic_run_gets_a_full_draft():
    # period 2: the copy runs past the end and goes on with what it copied
    assert propose_ngram([9, 1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert propose_ngram([4, 4, 4], 4) == [4, 4, 4, 4]


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        toks = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        lo, hi = int(rng.integers(1, 4)), int(rng.integers(3, 8))
        hi = max(lo, hi)
        want = _brute(toks, 6, lo, hi)
        assert propose_ngram(toks, 6, lo, hi) == want, (toks, lo, hi)


def _brute(toks, k, lo, hi):
    size = len(toks)
    for n in range(min(hi, size - 1), lo - 1, -1):
        for end in range(size - 2, n - 2, -1):
            if toks[end - n + 1 : end + 1] == toks[size - n :]:
                ext = list(toks)
                while len(ext) < end + 1 + k:
                    ext.append(ext[len(ext) - (size - end - 1)])
                return ext[end + 1 : end + 1 + k]
    return []
