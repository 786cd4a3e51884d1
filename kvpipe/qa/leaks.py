"""The leak check: once a server is idle, what every request holds while it runs must be back.

Read from a server's /server_info engine stats (`internal_states[0]`), by rule: "zero" must be 0,
"full" free_pages == total_pages, "baseline" back at its value in a warmed-up baseline reading.
A path the server does not report (in the baseline, or now when there is no baseline) is not
checked, and without a baseline the "baseline" rules are not checked. The soak checks against
its warmed-up baseline after the run; the kill -9 campaign without one after every round.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpipe.harness.probe import engine_stats
from kvpipe.qa.checks import Check, verdict

# (path in the engine stats, rule)
POOL_RULES: tuple[tuple[str, str], ...] = (
    ("num_running", "zero"),
    ("num_waiting", "zero"),
    ("num_reserved", "zero"),  # decode: pages reserved for an incoming transfer
    ("num_held", "zero"),  # prefill: finished requests whose pages a transfer still reads
    ("free_pages", "full"),
    ("disaggregation.active_rooms", "zero"),
    ("disaggregation.transfer_rooms", "zero"),  # rooms the transfer layer's book still holds
    ("disaggregation.staging_ring.live_slots", "baseline"),
    ("disaggregation.staging_ring.used_bytes", "baseline"),
    ("disaggregation.staging_ring.waiting", "baseline"),
)


def lookup(stats: Mapping[str, Any], path: str) -> Any:
    cur: Any = stats
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def pool_checks(server: str, now: Mapping[str, Any], baseline: Mapping[str, Any] | None = None) -> list[Check]:
    """The pools of one server against the rules (and its baseline, when given)."""
    out = []
    for path, rule in POOL_RULES:
        base = lookup(baseline if baseline is not None else now, path)
        if base is None or (rule == "baseline" and baseline is None):
            continue
        val = lookup(now, path)
        if rule == "zero":
            ok, want = val == 0, "0"
        elif rule == "full":
            total = lookup(now, "total_pages")
            ok, want = val is not None and val == total, f"total_pages {total}"
        else:
            ok, want = val == base, f"baseline {base}"
        out.append(Check(f"{server} {path}", ok, f"{val} (want {want})"))
    return out


@dataclass(frozen=True)
class Idle:
    """The last leak checks of a wait for idle servers, their last stats, and how long it took."""

    checks: list[Check]
    stats: dict[str, Any] = field(default_factory=dict)  # server -> engine stats (None: unreachable)
    waited_s: float = 0.0

    @property
    def ok(self) -> bool:
        return verdict(self.checks)


def wait_idle(
    urls: Mapping[str, str],
    timeout_s: float,
    baselines: Mapping[str, Mapping[str, Any]] | None = None,
    interval_s: float = 0.5,
) -> Idle:
    """Poll the servers (name -> url) until every leak check passes, at most `timeout_s`."""
    t0 = time.monotonic()
    while True:
        checks: list[Check] = []
        stats: dict[str, Any] = {}
        for name, url in urls.items():
            now = stats[name] = engine_stats(url)
            if now is None:
                checks.append(Check(f"{name} /server_info", False, "unreachable"))
            else:
                checks += pool_checks(name, now, None if baselines is None else baselines[name])
        waited = time.monotonic() - t0
        if verdict(checks) or waited >= timeout_s:
            return Idle(checks, stats, waited)
        time.sleep(interval_s)
