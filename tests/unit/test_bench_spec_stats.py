"""bench serve's speculative counts per server (bench/serve/spec_stats.py): from engine stats as
/server_info reports them; a server without speculation reports none."""

from __future__ import annotations

from kvpipe.bench.serve.spec_stats import spec_counts


def test_counts_and_acceptance_from_engine_stats():
    stats = {"num_running": 0, "spec_verify_steps": 10, "spec_proposed_tokens": 30, "spec_accepted_tokens": 12}
    c = spec_counts(stats)
    assert c == {"verify_steps": 10, "proposed": 30, "accepted": 12, "accept_rate": 0.4, "accept_length": 2.2}
    assert spec_counts({"spec_verify_steps": 0, "spec_proposed_tokens": 0, "spec_accepted_tokens": 0}) == {
        "verify_steps": 0,
        "proposed": 0,
        "accepted": 0,
        "accept_rate": 0.0,
        "accept_length": 0.0,
    }  # a PD prefill: speculative, never drafts


def test_no_speculation_no_counts():
    assert spec_counts(None) is None
    assert spec_counts({"num_running": 0}) is None
    assert spec_counts({"spec_verify_steps": 1, "spec_proposed_tokens": "3", "spec_accepted_tokens": 1}) is None
