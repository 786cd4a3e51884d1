"""What `kvpipe top` shows of one worker, from two readings of its /metrics (plain Python).

A `Scrape` is one /metrics text parsed with prometheus_client's parser: counters and gauges by
sample name (summed over their labels: one server has one role), histograms by family as
cumulative buckets. `worker_view(prev, cur)` turns two scrapes of a server into rates over the
interval and latency quantiles of the requests that finished in it (Prometheus'
`histogram_quantile`: linear inside the bucket). Without a previous scrape the rates are
averages since the server started and the quantiles cover its whole life.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# TTFT components as the servers export them (server/metrics.py PHASE_HISTOGRAMS), in request order
COMPONENTS = (
    ("queue", "kvpipe_queue_time_seconds"),
    ("prefill compute", "kvpipe_prefill_compute_seconds"),
    ("bootstrap wait", "kvpipe_bootstrap_wait_seconds"),
    ("transfer", "kvpipe_kv_transfer_seconds"),
    ("exposed transfer", "kvpipe_kv_transfer_exposed_seconds"),
    ("decode wait", "kvpipe_decode_wait_seconds"),
    ("kv wait", "kvpipe_kv_wait_seconds"),
)
TTFT = "kvpipe_time_to_first_token_seconds"
ITL = "kvpipe_inter_token_latency_seconds"
WORKER_INFO = "kvpipe_worker_info"  # its `name` label: the server's --worker-name (kvpipe launch's part name)
# tokens the engine generated, counted at each step: its rate is the speed of the running requests
# (kvpipe_generation_tokens_total counts a request's tokens when it finishes: 0 tok/s while it runs)
ENGINE_TOKENS = "kvpipe_engine_generated_tokens_total"
FINISHED_TOKENS = "kvpipe_generation_tokens_total"


@dataclass(frozen=True)
class Hist:
    """A histogram summed over its label sets: cumulative (upper bound, count), +Inf last."""

    buckets: tuple[tuple[float, float], ...]
    total: float  # _sum
    count: float

    def minus(self, older: Hist | None) -> Hist:
        """What was observed since `older` (None, or a reset server whose counts went down: all of it)."""
        if older is None or older.count > self.count or [b for b, _ in older.buckets] != [b for b, _ in self.buckets]:
            return self
        return Hist(
            tuple((b, c - o) for (b, c), (_, o) in zip(self.buckets, older.buckets)),
            self.total - older.total,
            self.count - older.count,
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: None without observations; the highest finite bound when
        the rank falls in the +Inf bucket."""
        if self.count <= 0:
            return None
        rank = q * self.count
        prev_bound, prev_count = 0.0, 0.0
        for bound, count in self.buckets:
            if count >= rank:
                if math.isinf(bound):
                    return prev_bound
                if count == prev_count:
                    return bound
                return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
            prev_bound, prev_count = bound, count
        return prev_bound

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None


@dataclass(frozen=True)
class Scrape:
    at: float  # time.monotonic() of the reading
    values: Mapping[str, float]  # counter / gauge sample name -> value (summed over labels)
    hists: Mapping[str, Hist]  # histogram family -> its buckets
    roles: frozenset[str] = frozenset()  # the `role` labels its samples carry
    names: frozenset[str] = frozenset()  # kvpipe_worker_info's `name` (--worker-name; none: unnamed)

    def value(self, name: str) -> float | None:
        return self.values.get(name)

    @property
    def name(self) -> str | None:
        return next(iter(sorted(self.names)), None)


def parse_metrics(text: str, at: float) -> Scrape:
    values: dict[str, float] = {}
    roles: set[str] = set()
    names: set[str] = set()
    parts: dict[str, dict[str, dict[float, float]]] = {}  # family -> "bucket"/"sum"/"count" -> ...
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "role" in s.labels:
                roles.add(s.labels["role"])
            if fam.name == WORKER_INFO and "name" in s.labels:
                names.add(s.labels["name"])
            if fam.type == "histogram":
                p = parts.setdefault(fam.name, {"bucket": {}, "sum": {}, "count": {}})
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    p["bucket"][le] = p["bucket"].get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    p["sum"][0.0] = p["sum"].get(0.0, 0.0) + s.value
                elif s.name.endswith("_count"):
                    p["count"][0.0] = p["count"].get(0.0, 0.0) + s.value
            elif fam.type in ("counter", "gauge", "untyped") and not s.name.endswith("_created"):
                values[s.name] = values.get(s.name, 0.0) + s.value
    hists = {
        name: Hist(tuple(sorted(p["bucket"].items())), p["sum"].get(0.0, 0.0), p["count"].get(0.0, 0.0))
        for name, p in parts.items()
    }
    return Scrape(at, values, hists, frozenset(roles), frozenset(names))


@dataclass(frozen=True)
class Latency:
    p50: float | None = None
    p99: float | None = None
    mean: float | None = None

    @classmethod
    def of(cls, h: Hist | None) -> Latency:
        return cls() if h is None else cls(h.quantile(0.5), h.quantile(0.99), h.mean())


@dataclass(frozen=True)
class WorkerView:
    """One row of `kvpipe top`: a worker's rates over the interval and what it holds now."""

    url: str
    role: str
    up: bool = True
    name: str | None = None  # its --worker-name (prefill0, decode1, ...); None: unnamed
    healthy: bool | None = None  # the router's opinion (None: not reported)
    interval_s: float | None = None  # None: since the server started
    uptime_s: float | None = None
    restarts: int = 0  # start-time changes seen since `kvpipe top` started
    requests_per_s: float | None = None
    tokens_per_s: float | None = None  # generated, by the running requests' steps (ENGINE_TOKENS)
    prompt_tokens_per_s: float | None = None
    transfer_gb_per_s: float | None = None  # KV bytes written (a prefill)
    ttft: Latency = field(default_factory=Latency)
    itl: Latency = field(default_factory=Latency)
    components: Mapping[str, Latency] = field(default_factory=dict)
    running: float | None = None
    waiting: float | None = None
    pages_used: float | None = None
    pages_total: float | None = None
    state_slots_used: float | None = None
    state_slots_total: float | None = None
    staging_slots: float | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        """What its row is called: its worker name, else its role."""
        return self.name or self.role


# labelled counters every server declares: no sample until the first request finished, i.e. zero
_ZERO_UNTIL_SEEN = ("kvpipe_requests_total", "kvpipe_generation_tokens_total", "kvpipe_prompt_tokens_total")


def _rate(cur: Scrape, prev: Scrape | None, name: str, seconds: float | None) -> float | None:
    now = cur.values.get(name, 0.0 if name in _ZERO_UNTIL_SEEN else None)
    if now is None or not seconds or seconds <= 0:
        return None
    before = prev.values.get(name, 0.0) if prev is not None else 0.0
    if before is None or before > now:  # a restarted server counts from 0 again
        before = 0.0
    return (now - before) / seconds


def _used(total: float | None, free: float | None) -> float | None:
    return None if total is None or free is None else total - free


def worker_view(
    url: str,
    cur: Scrape,
    prev: Scrape | None = None,
    role: str | None = None,
    healthy: bool | None = None,
    restarts: int = 0,
    wall_now: float | None = None,
) -> WorkerView:
    """`prev`: the same server's previous scrape (None, or a restarted server's: since its start).
    `wall_now`: Unix time of `cur` (for the uptime), `role`: the router's word for it."""
    started = cur.value("kvpipe_server_start_time_seconds")
    if prev is not None and prev.value("kvpipe_server_start_time_seconds") != started:
        prev = None  # restarted between the two readings: its counters started again
    uptime = wall_now - started if wall_now is not None and started is not None else None
    seconds = cur.at - prev.at if prev is not None else uptime
    bytes_rate = _rate(cur, prev, "kvpipe_kv_transfer_bytes_total", seconds)

    def hist(name: str) -> Hist | None:
        h = cur.hists.get(name)
        return None if h is None else h.minus(prev.hists.get(name) if prev is not None else None)

    comps = {label: Latency.of(hist(name)) for label, name in COMPONENTS if name in cur.hists}
    free_slots, total_slots = cur.value("kvpipe_free_state_slots"), cur.value("kvpipe_total_state_slots")
    return WorkerView(
        url=url,
        role=role or next(iter(sorted(cur.roles)), "?"),
        name=cur.name,
        healthy=healthy,
        interval_s=cur.at - prev.at if prev is not None else None,
        uptime_s=uptime,
        restarts=restarts,
        requests_per_s=_rate(cur, prev, "kvpipe_requests_total", seconds),
        tokens_per_s=_rate(cur, prev, ENGINE_TOKENS if ENGINE_TOKENS in cur.values else FINISHED_TOKENS, seconds),
        prompt_tokens_per_s=_rate(cur, prev, "kvpipe_prompt_tokens_total", seconds),
        transfer_gb_per_s=None if bytes_rate is None else bytes_rate / 1e9,
        ttft=Latency.of(hist(TTFT)),
        itl=Latency.of(hist(ITL)),
        components={k: v for k, v in comps.items() if v.mean is not None},
        running=cur.value("kvpipe_num_running_reqs"),
        waiting=cur.value("kvpipe_num_waiting_reqs"),
        pages_used=_used(cur.value("kvpipe_total_pages"), cur.value("kvpipe_free_pages")),
        pages_total=cur.value("kvpipe_total_pages"),
        state_slots_used=_used(total_slots, free_slots),
        state_slots_total=total_slots,
        staging_slots=cur.value("kvpipe_staging_live_slots"),
    )
