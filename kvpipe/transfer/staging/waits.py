"""How long slot requests waited for a decode rank's staging ring (plain Python, no Prometheus).

The agent's book observes one wait per granted slot request (0 when the ring had room at once,
else the time it queued FIFO behind a full ring); the decode's stats carry the counts and the
server's /metrics turns them into the `kvpipe_staging_wait_seconds` histogram at scrape time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

# from "granted at once" (below a millisecond) to the lease a queued request may wait at most
STAGING_WAIT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class WaitCounts:
    """counts[i]: waits in (bounds[i-1], bounds[i]]; the last count is above every bound."""

    bounds: tuple[float, ...] = STAGING_WAIT_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(STAGING_WAIT_BUCKETS_S) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1  # a wait equal to a bound is in it (le)
        self.total_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def as_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total_s}
