"""The kill -9 campaign's result: one JSON object over its rounds (kills per target and phase,
in-flight outcomes, restart times, leaks) and a table."""

from __future__ import annotations

import os
import platform
import statistics
from collections import Counter
from typing import Any

from kvpipe.harness.machine import cpu_name
from kvpipe.launch.stack import PDStack
from kvpipe.qa.chaos_plan import ChaosConfig
from kvpipe.qa.chaos_round import RoundResult, rounded


def fmt_s(x: float | None) -> str:
    """Seconds to a tenth, "-" when unknown."""
    return "-" if x is None else f"{x:.1f}"


def summarize(cfg: ChaosConfig, results: list[RoundResult], stack: PDStack | None) -> dict[str, Any]:
    inflight: Counter[str] = Counter()
    for r in results:
        inflight.update(r.inflight)
    times: dict[str, list[float]] = {}
    for r in results:
        if r.restart_s is not None:
            times.setdefault(r.target, []).append(r.restart_s)
    return {
        "config": {
            "rounds": cfg.rounds,
            "seed": cfg.seed,
            "clients": cfg.clients,
            "tp_side": cfg.tp_side,
            "inflight_deadline_s": cfg.inflight_deadline_s,
            "recover_timeout_s": cfg.recover_timeout_s,
            "server_args": list(cfg.server_args),
            "model_path": cfg.model_path,
            "policy": {
                "max_restarts": cfg.policy.max_restarts,
                "window_s": cfg.policy.window_s,
                "backoff_s": cfg.policy.backoff_s,
                "backoff_max_s": cfg.policy.backoff_max_s,
            },
        },
        "machine": {
            "cpu": cpu_name(),
            "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "load_avg_end": list(os.getloadavg()),
        },
        "rounds_run": len(results),
        "rounds_ok": sum(r.ok for r in results),
        "kills": {f"{t}/{p}": n for (t, p), n in sorted(Counter((r.target, r.phase.value) for r in results).items())},
        "inflight": dict(inflight),
        "hung": sum(len(r.hung) for r in results),
        "restart_s": {
            t: {"n": len(v), "min": rounded(min(v)), "median": rounded(statistics.median(v)), "max": rounded(max(v))}
            for t, v in sorted(times.items())
        },
        "leaks_found": sum(len(r.leaks) for r in results),
        "survivors_restarted": sum(len(r.survivors_restarted) for r in results),
        "supervisor_restarts": stack.restarts if stack is not None else {},
        "rounds": [r.as_dict() for r in results],
    }


def table(summary: dict[str, Any]) -> str:
    head = f"{'round':>5}  {'target':<8} {'phase':<9} {'ok':<4} {'restart s':>9} {'serving s':>9}  in flight"
    lines = [head]
    for r in summary["rounds"]:
        lines.append(
            f"{r['round']:>5}  {r['target']:<8} {r['phase']:<9} {'yes' if r['ok'] else 'NO':<4} "
            f"{fmt_s(r['restart_s']):>9} {fmt_s(r['first_success_s']):>9}  "
            + ", ".join(f"{k} {v}" for k, v in sorted(r["inflight"].items()))
        )
    lines.append(
        f"{summary['rounds_ok']}/{summary['rounds_run']} rounds ok; in flight at the kills: "
        + ", ".join(f"{k} {v}" for k, v in sorted(summary["inflight"].items()))
        + f"; hung {summary['hung']}; leaks {summary['leaks_found']}; "
        f"survivors restarted {summary['survivors_restarted']}"
    )
    return "\n".join(lines)
