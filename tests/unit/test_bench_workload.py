"""Synthetic workload: exact lengths, determinism, Poisson arrivals, shared prefixes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvpipe.bench.workload import LengthSpec, WorkloadConfig, arrival_times, build_workload, parse_lengths


def cfg(**kw) -> WorkloadConfig:
    base = dict(prompt_lens=parse_lengths("16,64"), output_lens=parse_lengths("4"), num_requests=6, vocab_size=100)
    return WorkloadConfig(**(base | kw))


def test_parse_lengths_forms() -> None:
    assert parse_lengths("1024") == LengthSpec(values=(1024,))
    assert parse_lengths("256, 1024,2048").values == (256, 1024, 2048)
    assert parse_lengths(7).values == (7,)
    assert parse_lengths([3, 5]).values == (3, 5)
    r = parse_lengths("uniform:10:20")
    assert r.is_range and (r.low, r.high, r.min(), r.max()) == (10, 20, 10, 20)
    assert r.describe() == "uniform:10:20" and parse_lengths("3,5").describe() == "3,5"
    for bad in ("0", "-3", "", "abc", "uniform:5", "uniform:9:3", "uniform:0:4", "uniform:1:2:3"):
        with pytest.raises(ValueError):
            parse_lengths(bad)


def test_lengths_are_exact_and_cycled() -> None:
    w = build_workload(cfg(output_lens=parse_lengths("3,5,7")))
    assert [r.prompt_len for r in w.requests] == [16, 64, 16, 64, 16, 64]
    assert [r.max_tokens for r in w.requests] == [3, 5, 7, 3, 5, 7]
    assert all(0 <= t < 100 for r in w.requests for t in r.prompt)
    assert w.total_prompt_tokens == 3 * 80 and w.total_output_tokens == 30
    body = w.requests[1].body()
    assert body["input_ids"] == list(w.requests[1].prompt) and body["stream"] is True
    assert body["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}


def test_uniform_lengths_stay_in_range() -> None:
    w = build_workload(cfg(prompt_lens=parse_lengths("uniform:5:9"), num_requests=200))
    lens = {r.prompt_len for r in w.requests}
    assert lens <= set(range(5, 10)) and len(lens) > 1


def test_deterministic_for_a_seed_and_different_across_seeds() -> None:
    a, b = build_workload(cfg(seed=3, request_rate=2.0)), build_workload(cfg(seed=3, request_rate=2.0))
    assert a.requests == b.requests
    c = build_workload(cfg(seed=4, request_rate=2.0))
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]


def test_token_id_low_excludes_low_ids() -> None:
    w = build_workload(cfg(vocab_size=20, token_id_low=15, num_requests=4))
    assert all(15 <= t < 20 for r in w.requests for t in r.prompt)


def test_arrivals_infinite_rate_and_poisson() -> None:
    rng = np.random.default_rng(0)
    assert arrival_times(5, math.inf, rng) == [0.0] * 5
    t = arrival_times(4000, 10.0, np.random.default_rng(1))
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    mean_gap = t[-1] / (len(t) - 1)
    assert 0.09 < mean_gap < 0.11  # 1/rate within a few standard errors (seeded: deterministic)
    w = build_workload(cfg(request_rate=5.0))
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests)
    assert w.requests[-1].arrival_s > 0


def test_shared_prefix_groups() -> None:
    w = build_workload(
        cfg(prompt_lens=parse_lengths("40"), num_requests=7, num_prefix_groups=3, prefix_len=32, vocab_size=50_000)
    )
    groups = [w.prefix_group(r.index) for r in w.requests]
    assert groups == [0, 1, 2, 0, 1, 2, 0]
    by_group: dict[int | None, set] = {}
    for r, g in zip(w.requests, groups):
        assert r.prompt_len == 40
        by_group.setdefault(g, set()).add(r.prompt[:32])
    assert all(len(s) == 1 for s in by_group.values())  # one prefix per group
    assert len({next(iter(s)) for s in by_group.values()}) == 3  # distinct across groups
    tails = [r.prompt[32:] for r in w.requests]
    assert len(set(tails)) == len(tails)  # the rest is per request


def test_invalid_configs() -> None:
    with pytest.raises(ValueError):
        cfg(num_requests=0)
    with pytest.raises(ValueError):
        cfg(request_rate=0.0)
    with pytest.raises(ValueError):
        cfg(token_id_low=100)
    with pytest.raises(ValueError):  # the prefix must leave room for a per-request part
        cfg(num_prefix_groups=2, prefix_len=16)
