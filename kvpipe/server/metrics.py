"""Prometheus metrics of one server, in a registry of its own (no process-global state).

Counters and histograms are fed by the async bridge as requests finish (the phase histograms from
each request's timeline, kvpipe/engine/timeline.py, labelled by the server's role) and, for the
inter-token latency, as tokens reach a request's stream; the engine gauges (running / waiting
requests, free pages) and the staging-ring waits are read from `Engine.stats()` at scrape time, so
they are never stale and cost nothing between scrapes. `per_request` False
(--disable-request-metrics): the latency histograms stay at zero, the counters still count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvpipe.engine.timeline import TimelineRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# phases of one request: from a millisecond (a queue nobody waited in) to a minute (a long prompt on CPU)
_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# KV bytes of one request: 64 KiB (a short prompt of a small model) to 4 GiB, x4 apart
_BYTES_BUCKETS = tuple(float(4**k * 65536) for k in range(9))
# prompt tokens a request took from the prefix cache: le=0 counts the requests that hit nothing
_TOKENS_BUCKETS = (0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0)

# TimelineRecord.components() key -> (histogram name, help, the roles that have the phase); labelled by role
PHASE_HISTOGRAMS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "queue": (
        "kvpipe_queue_time_seconds",
        "Arrival to the first prefill batch",
        ("colocated", "prefill"),
    ),
    "prefill_compute": (
        "kvpipe_prefill_compute_seconds",
        "Prefill forwards of one request, its chunks summed",
        ("colocated", "prefill"),
    ),
    "bootstrap_wait": (
        "kvpipe_bootstrap_wait_seconds",
        "Arrival to the decode's page table for the request reaching the prefill's sender",
        ("prefill",),
    ),
    "transfer": (
        "kvpipe_kv_transfer_seconds",
        "First KV write of one request submitted to its last one done",
        ("prefill",),
    ),
    "exposed_transfer": (
        "kvpipe_kv_transfer_exposed_seconds",
        "Last prefill forward end to the last KV write done: the transfer layer pipelining did not hide",
        ("prefill",),
    ),
    "decode_wait": (
        "kvpipe_decode_wait_seconds",
        "Arrival to the prompt's pages reserved and its KV asked for",
        ("decode",),
    ),
    "kv_wait": (
        "kvpipe_kv_wait_seconds",
        "Pages reserved to the KV and first token arrived",
        ("decode",),
    ),
}

# Engine.stats() key -> (metric name, help)
_GAUGES = {
    "num_running": ("kvpipe_num_running_reqs", "Requests holding KV pages (prefilling or decoding)"),
    "num_waiting": ("kvpipe_num_waiting_reqs", "Requests queued for admission"),
    "free_pages": ("kvpipe_free_pages", "KV cache pages free for new requests"),
    "total_pages": ("kvpipe_total_pages", "KV cache pages in the pool"),
    "cached_pages": ("kvpipe_cached_pages", "KV pages held by the radix prefix cache (in use or evictable)"),
    # PD prefill (layer-pipelined KV transfer)
    "num_groups": ("kvpipe_num_layer_groups", "Layer groups of the last prefill batch (1: plain transfer)"),
    # hybrid models (recurrent state per running request)
    "free_state_slots": ("kvpipe_free_state_slots", "Recurrent-state slots free for new requests (hybrid models)"),
    "total_state_slots": ("kvpipe_total_state_slots", "Recurrent-state slots in the pool (hybrid models)"),
}


# speculative decoding (Engine.stats() with --speculative-algorithm): key -> help; the metric is kvpipe_<key>
_SPEC_COUNTERS = {
    "spec_verify_steps": "Verify steps of decode rows (each emits 1 + accepted drafts tokens)",
    "spec_proposed_tokens": "Draft tokens proposed and verified",
    "spec_accepted_tokens": "Draft tokens the target model accepted",
}


def _staging_waits(model: str, waits: Mapping[str, Any] | None) -> HistogramMetricFamily:
    """A decode rank 0's staging-ring waits (transfer/staging/waits.py; none: staging off)."""
    fam = HistogramMetricFamily(
        "kvpipe_staging_wait_seconds",
        "Staging slot requests granted by this decode (TP rank 0's ring): how long each queued behind a full ring",
        labels=["model_name", "role"],
    )
    bounds = list(waits["bounds"]) if waits else list(_PHASE_BUCKETS)  # the ring's own bounds when it has one
    counts = list(waits["counts"]) if waits else [0] * (len(bounds) + 1)
    cumulative, buckets = 0, []
    for bound, n in zip([*(str(float(b)) for b in bounds), "+Inf"], counts):
        cumulative += n
        buckets.append((bound, float(cumulative)))
    fam.add_metric([model, "decode"], buckets, float(waits["sum"]) if waits else 0.0)
    return fam


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict | None], model: str = "", started_at: float | None = None) -> None:
        self._stats = stats
        self._model = model
        self._started_at = started_at

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        if self._started_at is not None:
            yield GaugeMetricFamily(
                "kvpipe_server_start_time_seconds",
                "Unix time this server process started (a new value: it was restarted)",
                value=self._started_at,
            )
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
        if "generated_tokens" in stats:
            yield CounterMetricFamily(
                "kvpipe_engine_generated_tokens",
                "Tokens this server's forwards generated, counted each step (kvpipe_generation_tokens "
                "counts them as requests finish): its rate is the running requests' speed",
                value=float(stats["generated_tokens"]),
            )
        for key, doc in _SPEC_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(f"kvpipe_{key}", doc, value=float(stats[key]))
        pd = stats.get("disaggregation")
        if isinstance(pd, dict) and pd.get("mode") == "decode":  # at zero with the staging ring off
            yield _staging_waits(self._model, pd.get("staging_waits"))
            ring = pd.get("staging_ring")
            if isinstance(ring, dict) and "live_slots" in ring:
                yield GaugeMetricFamily(
                    "kvpipe_staging_live_slots",
                    "Slots of this decode's staging ring (TP rank 0's) granted and not yet freed",
                    value=float(ring["live_slots"]),
                )
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
        store = stats.get("kv_store")
        if isinstance(store, dict):
            yield from _store_metrics(store)


def _store_metrics(store: dict) -> Iterator[CounterMetricFamily]:
    """The KV tier's counters (--enable-hierarchical-cache; kvpipe/cache/store_tier.py)."""
    pages = CounterMetricFamily(
        "kvpipe_kv_store_pages",
        "KV pages this server fetched from the KV store into its pool, put into the store, or "
        "rejected (a record that failed its key or digest check)",
        labels=["event"],
    )
    for event in ("fetched", "put", "rejected"):
        pages.add_metric([event], float(store.get(f"pages_{event}", 0)))
    yield pages
    fallbacks = CounterMetricFamily(
        "kvpipe_kv_store_fallbacks",
        "Prompts whose stored pages were computed instead: the store down (skipped while it "
        "recovers), slow (timeout), still busy with a slow fetch, or failing now (error)",
        labels=["reason"],
    )
    for reason, n in sorted(store.get("fallbacks", {}).items()):
        fallbacks.add_metric([reason], float(n))
    yield fallbacks
    dropped = CounterMetricFamily(
        "kvpipe_kv_store_dropped_puts",
        "KV pages not put into the store: its queue full, the store down, or the put refused (full)",
        labels=["reason"],
    )
    for reason, n in sorted(store.get("puts_dropped", {}).items()):
        dropped.add_metric([reason], float(n))
    yield dropped


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], dict | None],
        role: str = "colocated",
        per_request: bool = True,
        worker_name: str | None = None,
    ) -> None:
        """`role`: colocated, prefill or decode (the label of the timeline histograms);
        `per_request` False: the latency histograms are not fed (--disable-request-metrics);
        `worker_name`: --worker-name, exported as kvpipe_worker_info (`kvpipe top` names rows by it)."""
        self.registry = CollectorRegistry(auto_describe=True)
        if worker_name is not None:
            info = Gauge(
                "kvpipe_worker_info",
                "Always 1: this server's --worker-name and role",
                ["name", "role"],
                registry=self.registry,
            )
            info.labels(worker_name, role).set(1)
        labels = ["model_name"]
        self._model = model_name
        self.role = role
        self.per_request = per_request
        by_role = [*labels, "role"]
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
            "Time to first token (a PD prefill: to its answer, after the KV transfer)",
            by_role,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvpipe_inter_token_latency_seconds",
            "Gap between output tokens reaching a request's stream; tokens that arrive together "
            "(speculative decoding) each count the gap divided among them",
            by_role,
            buckets=_TPOT_BUCKETS,
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
        self.registry.register(_EngineStatsCollector(stats, model_name, time.time()))
        self.phases = {
            key: Histogram(name, doc, by_role, buckets=_PHASE_BUCKETS, registry=self.registry)
            for key, (name, doc, _) in PHASE_HISTOGRAMS.items()
        }
        self.transfer_bytes = Histogram(
            "kvpipe_kv_transfer_request_bytes",
            "KV bytes written for one request (prefill, TP rank 0's share)",
            by_role,
            buckets=_BYTES_BUCKETS,
            registry=self.registry,
        )
        self.prefix_hit = Histogram(
            "kvpipe_request_prefix_hit_tokens",
            "Prompt tokens one admitted request took from this server's prefix cache",
            by_role,
            buckets=_TOKENS_BUCKETS,
            registry=self.registry,
        )
        # the series of this role's phases exist (at zero) from the start: a scrape before the
        # first request shows them, and a rate() over the first one is not lost; kept, as a
        # labels() lookup per observation is most of what a request's observations cost
        self._phase_series = {
            key: self.phases[key].labels(model_name, role)
            for key, (_, _, roles) in PHASE_HISTOGRAMS.items()
            if role in roles
        }
        self._bytes_series = self.transfer_bytes.labels(model_name, role) if role == "prefill" else None
        self._prefix_series = self.prefix_hit.labels(model_name, role)
        self._ttft_series = self.ttft.labels(model_name, role)
        # a prefill emits one token: no gaps
        self._itl_series = self.itl.labels(model_name, role) if role != "prefill" else None

    def on_first_token(self, ttft_s: float) -> None:
        if self.per_request:
            self._ttft_series.observe(ttft_s)

    def on_tokens(self, gap_s: float, n: int) -> None:
        """`n` output tokens reached a stream together, `gap_s` after the ones before them: each
        counts gap_s / n (SGLang's convention), so the sum is the stream's time after its first
        token and the count its tokens after the first."""
        series = self._itl_series
        if not self.per_request or series is None or n < 1:
            return
        each = gap_s / n
        for _ in range(n):
            series.observe(each)

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
        if not self.per_request:
            return
        self.e2e.labels(self._model).observe(e2e_s)
        if ttft_s is not None and completion_tokens > 1:
            self.tpot.labels(self._model).observe((e2e_s - ttft_s) / (completion_tokens - 1))

    def on_timeline(self, record: TimelineRecord) -> None:
        """A finished request's phases (the engine's timeline of it)."""
        if not self.per_request:
            return
        comps = record.components()
        for key, seconds in comps.items():
            series = self._phase_series.get(key)  # only this role's phases
            if series is not None:
                series.observe(seconds)
        if record.transfer_bytes is not None and self._bytes_series is not None:
            self._bytes_series.observe(record.transfer_bytes)
        if "queue" in comps or "decode_wait" in comps:  # admitted: it met the prefix cache
            self._prefix_series.observe(record.prefix_hit_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
