"""Per-request recording (issue 29): the inter-token latency convention (tokens that arrive
together share their gap), the role-labelled TTFT, and --disable-request-metrics, which stops
the timelines and the latency histograms but not the counters."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.commands.flags import add_http_api_args, add_server_args, server_config_from_args
from kvpipe.engine.timeline import Phase, Timeline
from kvpipe.server.metrics import ServerMetrics


def samples(m: ServerMetrics) -> dict[tuple[str, str], float]:
    """(sample name, its labels as one sorted string) -> value."""
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"))] = s.value
    return out


def test_tokens_that_arrive_together_share_their_gap() -> None:
    m = ServerMetrics("tiny", lambda: None, "decode")
    m.on_tokens(0.02, 1)  # one token 20 ms after the one before
    m.on_tokens(0.3, 3)  # a speculative step: 3 tokens 300 ms later, 100 ms each
    got = samples(m)
    assert got[("kvpipe_inter_token_latency_seconds_count", "role=decode")] == 4
    assert got[("kvpipe_inter_token_latency_seconds_sum", "role=decode")] == pytest.approx(0.32, rel=1e-15)
    assert got[("kvpipe_inter_token_latency_seconds_bucket", "le=0.025,role=decode")] == 1
    assert got[("kvpipe_inter_token_latency_seconds_bucket", "le=0.05,role=decode")] == 1
    assert got[("kvpipe_inter_token_latency_seconds_bucket", "le=0.1,role=decode")] == 4


def test_a_prefill_has_no_inter_token_series_and_ttft_carries_the_role() -> None:
    m = ServerMetrics("tiny", lambda: None, "prefill")
    m.on_first_token(0.5)
    m.on_tokens(0.1, 1)  # never happens on a prefill (one token); ignored if it did
    got = samples(m)
    assert got[("kvpipe_time_to_first_token_seconds_count", "role=prefill")] == 1
    assert not any(name.startswith("kvpipe_inter_token_latency") for name, _ in got)


def test_recording_off_keeps_counters_and_feeds_no_latency_histogram() -> None:
    m = ServerMetrics("tiny", lambda: None, "colocated", per_request=False)
    m.on_first_token(0.1)
    m.on_tokens(0.05, 2)
    m.on_finish("length", 5, 0, 3, 0.5, 0.1)
    tl = Timeline(enabled=False)
    tl.mark(Phase.ARRIVED, 1.0)
    assert tl.events == [] and tl.record() is None  # nothing for on_timeline to observe
    got = samples(m)
    assert got[("kvpipe_requests_total", "finish_reason=length")] == 1
    assert got[("kvpipe_generation_tokens_total", "")] == 3
    counts = {k: v for k, v in got.items() if k[0].endswith("_count")}
    assert counts and set(counts.values()) == {0.0}, counts  # every histogram exists, at zero


@pytest.mark.parametrize(("argv", "want"), [([], True), (["--disable-request-metrics"], False)])
def test_disable_request_metrics_flag(tmp_path, argv: list[str], want: bool) -> None:
    p = argparse.ArgumentParser()
    add_server_args(p)
    add_http_api_args(p)
    assert server_config_from_args(p.parse_args(["--model-path", str(tmp_path), *argv])).request_metrics is want
