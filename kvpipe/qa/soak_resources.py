"""The soak's resource readings of each server's process group: the series (a baseline after
warm-up, samples during the run from a thread, a final reading once idle), their deltas, and the
leak bounds on them."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpipe.qa.checks import Check
from kvpipe.qa.soak_plan import Bounds
from kvpipe.qa.soak_procs import ProcSample, sample_group

MAX_SAMPLES = 100_000  # bound on the sampler's loop, whatever the interval

SERIES_COLUMNS = ["t_s", "rss_mb", "fds", "threads", "procs"]


@dataclass
class ResourceSeries:
    """Samples of one server: `baseline` after warm-up, `during` the run, `final` once idle."""

    baseline: ProcSample | None = None
    during: list[ProcSample] = field(default_factory=list)
    final: ProcSample | None = None

    def deltas(self) -> dict[str, float] | None:
        if self.baseline is None or self.final is None:
            return None
        b, f = self.baseline, self.final
        peak = max([s.rss_kb for s in self.during] + [b.rss_kb, f.rss_kb])
        # growth over the run's second half: a per-request leak keeps growing there, while the
        # allocators' high-water steps mostly come early
        mid = self.during[len(self.during) // 2].rss_kb if self.during else b.rss_kb
        return {
            "rss_mb": round((f.rss_kb - b.rss_kb) / 1024, 1),
            "peak_rss_growth_mb": round((peak - b.rss_kb) / 1024, 1),
            "rss_second_half_mb": round((f.rss_kb - mid) / 1024, 1),
            "fds": f.fds - b.fds,
            "threads": f.threads - b.threads,
            "procs": f.procs - b.procs,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "columns": SERIES_COLUMNS,
            "baseline": self.baseline.as_row() if self.baseline else None,
            "during": [s.as_row() for s in self.during],
            "final": self.final.as_row() if self.final else None,
            "deltas": self.deltas(),
        }


def resource_checks(server: str, series: ResourceSeries, bounds: Bounds, unwarmed: int = 0) -> list[Check]:
    """`unwarmed`: concurrent requests the warm-up did not reach (fewer warm-up requests than the
    load's concurrency); the router may open a keep-alive connection to the server for each, so
    each raises the fd bound by one."""
    d = series.deltas()
    fd_bound = bounds.fd_delta + max(0, unwarmed)
    if d is None:
        return [Check(f"{server} resources sampled", False, "no baseline or final sample (process gone?)")]
    return [
        Check(
            f"{server} RSS growth",
            d["rss_mb"] < bounds.rss_growth_mb,
            f"{d['rss_mb']:+.1f} MB (bound < {bounds.rss_growth_mb:g} MB)",
        ),
        # one-sided: fewer fds than the baseline is the router's idle keep-alive connections closing
        # (a 2,000-request run ended 9 below), not a leak
        Check(f"{server} open fds", d["fds"] <= fd_bound, f"{d['fds']:+d} (bound +{fd_bound})"),
        Check(
            f"{server} threads",
            d["threads"] <= bounds.thread_delta,
            f"{d['threads']:+d} (bound +{bounds.thread_delta})",
        ),
        Check(f"{server} processes", d["procs"] == 0, f"{d['procs']:+d}"),
    ]


class Sampler:
    """A thread sampling each server's process group every `interval_s` until stopped."""

    def __init__(
        self, pgids: Mapping[str, int], series: Mapping[str, ResourceSeries], t0: float, interval_s: float
    ) -> None:
        self.pgids, self.series, self.t0, self.interval_s = pgids, series, t0, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def sample(self) -> dict[str, ProcSample | None]:
        t = time.monotonic() - self.t0
        return {name: sample_group(pgid, t) for name, pgid in self.pgids.items()}

    def _run(self) -> None:
        for _ in range(MAX_SAMPLES):
            if self._stop.wait(self.interval_s):
                return
            for name, s in self.sample().items():
                if s is not None:
                    self.series[name].during.append(s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
