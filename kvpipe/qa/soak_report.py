"""The soak's report: transfer rooms that succeeded or failed during the run, and the plain-text
summary of the result."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpipe.qa.leaks import lookup


def room_deltas(baseline: Mapping[str, Any], final: Mapping[str, Any]) -> dict[str, int | None]:
    """Transfer rooms that succeeded / failed during the run (the injected failures show here even
    when the router retried them away from the client)."""
    out: dict[str, int | None] = {}
    for key in ("rooms_succeeded", "rooms_failed"):
        b, f = lookup(baseline, f"disaggregation.{key}"), lookup(final, f"disaggregation.{key}")
        out[key] = f - b if isinstance(b, int) and isinstance(f, int) else None
    return out


def table(result: Mapping[str, Any]) -> str:
    """A short plain-text summary: outcomes by kind, latency, resource deltas, failed checks."""
    outcomes = list(result["counts"]["by_outcome"])
    lines = [f"{'requests':<20}" + "".join(f"{o:>13}" for o in outcomes)]
    for kind, row in result["counts"]["by_kind"].items():
        lines.append(f"{kind:<20}" + "".join(f"{row[o]:>13}" for o in outcomes))
    lines.append(f"{'total':<20}" + "".join(f"{result['counts']['by_outcome'][o]:>13}" for o in outcomes))
    lat = result["latency_ms"]
    lines.append("latency ms  " + "  ".join(f"{o} p50 {v['p50']:,.0f} p90 {v['p90']:,.0f}" for o, v in lat.items()))
    rooms = result["transfer_rooms"]
    lines.append(
        "KV transfer rooms during the run: "
        + ", ".join(
            f"{name} {r['rooms_succeeded']} succeeded / {r['rooms_failed']} failed" for name, r in rooms.items()
        )
    )
    for name, res in result["resources"].items():
        d = res["deltas"]
        if d:
            lines.append(
                f"{name:<8} RSS {d['rss_mb']:+.1f} MB (peak {d['peak_rss_growth_mb']:+.1f}, second half "
                f"{d['rss_second_half_mb']:+.1f})  "
                f"fds {d['fds']:+d}  threads {d['threads']:+d}  procs {d['procs']:+d}"
            )
    lf = result.get("link_fault")
    if lf:
        r = lf["replay"]
        lines.append(
            f"link fault {lf['fault']}: applied at {lf['applied_s']} s, healed at {lf['healed_s']} s, load "
            f"ended at {lf['load_s']} s; served {lf['probe_served_after_heal_s']} s after the heal (probe; "
            f"the load's requests all served from {lf['load_served_after_heal_s']} s); "
            f"replayed {r['checked']}: {r['exact']} exact, {r['differ']} differ, {r['failed']} failed"
        )
    failed = [c for c in result["checks"] if not c["ok"]]
    lines.append(
        f"checks: {len(result['checks']) - len(failed)}/{len(result['checks'])} passed"
        + "".join(f"\n  FAILED {c['name']}: {c['detail']}" for c in failed)
    )
    return "\n".join(lines)
