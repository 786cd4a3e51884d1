"""Prometheus metrics of one server, in a registry of its own (no process-global state).

Counters and histograms are fed by the async bridge as requests finish; the engine gauges
(running / waiting requests, free pages) are read from `Engine.stats()` at scrape time, so they
are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# Engine.stats() key -> (metric name, help)
_GAUGES = {
    "num_running": ("kvpipe_num_running_reqs", "Requests holding KV pages (prefilling or decoding)"),
    "num_waiting": ("kvpipe_num_waiting_reqs", "Requests queued for admission"),
    "free_pages": ("kvpipe_free_pages", "KV cache pages free for new requests"),
    "total_pages": ("kvpipe_total_pages", "KV cache pages in the pool"),
    "cached_pages": ("kvpipe_cached_pages", "KV pages held by the radix prefix cache (in use or evictable)"),
    # PD prefill (layer-pipelined KV transfer)
    "num_groups": ("kvpipe_num_layer_groups", "Layer groups of the last prefill batch (1: plain transfer)"),
}


# speculative decoding (Engine.stats() with --speculative-algorithm): key -> help; the metric is kvpipe_<key>
_SPEC_COUNTERS = {
    "spec_verify_steps": "Verify steps of decode rows (each emits 1 + accepted drafts tokens)",
    "spec_proposed_tokens": "Draft tokens proposed and verified",
    "spec_accepted_tokens": "Draft tokens the target model accepted",
}


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats() or {}
        for key, (name, doc) in _GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        if "prefix_hit_tokens" in stats:
            yield CounterMetricFamily(
                "kvpipe_prefix_hit_tokens",
                "Prompt tokens admitted requests took from this "
                "server's prefix cache (a PD decode: KV not transferred)",
                value=float(stats["prefix_hit_tokens"]),
            )
        for key, doc in _SPEC_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(f"kvpipe_{key}", doc, value=float(stats[key]))
        pd = stats.get("disaggregation")
        if isinstance(pd, dict) and isinstance(pd.get("bytes_written"), int):
            yield CounterMetricFamily(
                "kvpipe_kv_transfer_bytes",
                "KV bytes this prefill wrote to decode servers",
                value=float(pd["bytes_written"]),
            )
        if isinstance(pd, dict) and isinstance(pd.get("auth_rejected"), dict):
            c = CounterMetricFamily(
                "kvpipe_pd_auth_rejected",
                "Bootstrap calls and control-plane frames rejected "
                "for a missing or wrong auth tag, a stale timestamp or a replay",
                labels=["plane"],
            )
            for plane, n in sorted(pd["auth_rejected"].items()):
                c.add_metric([plane], float(n))
            yield c
        if isinstance(pd, dict) and isinstance(pd.get("handshakes_refused"), dict):
            c = CounterMetricFamily(
                "kvpipe_pd_handshakes_refused",
                "PD requests failed because decode and prefill refused each other's handshake "
                "(KV dtype, page size, layout, model digest, fp8 scales, state layout, speculative "
                "settings), by the first field that differed",
                labels=["reason"],
            )
            for reason, n in sorted(pd["handshakes_refused"].items()):
                c.add_metric([reason], float(n))
            yield c
        by_groups = stats.get("layer_group_batches")
        if isinstance(by_groups, dict):
            c = CounterMetricFamily(
                "kvpipe_prefill_batches_by_layer_groups",
                "Prefill batches by the number of layer groups they ran as",
                labels=["groups"],
            )
            for groups, n in sorted(by_groups.items()):
                c.add_metric([str(groups)], float(n))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], dict | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self._model = model_name
        self.requests = Counter(
            "kvpipe_requests", "Finished requests by finish reason", [*labels, "finish_reason"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "kvpipe_prompt_tokens", "Prompt tokens of finished requests", labels, registry=self.registry
        )
        self.cached_tokens = Counter(
            "kvpipe_cached_tokens", "Prompt tokens served from the prefix cache", labels, registry=self.registry
        )
        self.generation_tokens = Counter("kvpipe_generation_tokens", "Generated tokens", labels, registry=self.registry)
        self.ttft = Histogram(
            "kvpipe_time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "kvpipe_time_per_output_token_seconds",
            "Mean time per output token after the first",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvpipe_e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(stats))

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self._model).observe(ttft_s)

    def on_finish(
        self,
        finish_reason: str,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        e2e_s: float,
        ttft_s: float | None,
    ) -> None:
        self.requests.labels(self._model, finish_reason).inc()
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.cached_tokens.labels(self._model).inc(cached_tokens)
        self.generation_tokens.labels(self._model).inc(completion_tokens)
        self.e2e.labels(self._model).observe(e2e_s)
        if ttft_s is not None and completion_tokens > 1:
            self.tpot.labels(self._model).observe((e2e_s - ttft_s) / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
