"""`kvpipe bench serve --compare-colocated`: the local PD stack against one colocated server.

Both run on this machine, one after the other (or interleaved), with the same workload: the PD
stack as `kvpipe launch` starts it (server defaults, the cores split between prefill and decode)
and a colocated `kvpipe serve` on every core. The figures are medians and p90s of the same run,
and PD/colocated ratios. Plain Python over sweep points (kvpipe/bench/serve/sweep.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpipe.bench.serve.sweep import INPROC, PD, SweepPoint

COMPARE_MODES = (PD, INPROC)
COMPARE_KEYS = ("e2e_p50_ms", "e2e_p90_ms", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms")


# per side: how many completed, and the prompt tokens the server counted (a chat's rendered prompt)
_COUNTS = ("completed", "failed", "prompt_tokens_mean")


def _prompt_head(r: Mapping[str, Any]) -> str:
    """'prompt N tokens', and the server's mean count where it differs (chat: the rendered prompt)."""
    counted = r["pd"].get("prompt_tokens_mean") or r["colocated"].get("prompt_tokens_mean")
    if counted is None or round(counted) == r["prompt_len"]:
        return f"prompt {r['prompt_len']} tokens (ms)"
    return f"prompt {r['prompt_len']} tokens, {counted:,.0f} as the server counted them (ms)"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_rows(points: Iterable[SweepPoint]) -> list[dict[str, Any]]:
    """Per prompt length: the PD and colocated figures of COMPARE_KEYS and PD/colocated ratios."""
    by_key = {(p.prompt_len, p.mode): p.summary for p in points}
    rows = []
    for n in sorted({n for n, _ in by_key}):
        pd, colo = by_key.get((n, PD)), by_key.get((n, INPROC))
        if pd is None or colo is None:
            continue
        rows.append(
            {
                "prompt_len": n,
                "pd": {k: pd.get(k) for k in (*COMPARE_KEYS, *_COUNTS)},
                "colocated": {k: colo.get(k) for k in (*COMPARE_KEYS, *_COUNTS)},
                "ratio": {k: _ratio(pd.get(k), colo.get(k)) for k in COMPARE_KEYS},
            }
        )
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _cores(threads: Mapping[str, Any] | None) -> str:
    """'1 thread, cores 0' from a server's /server_info cpu_threads (or '?' when unknown)."""
    if not threads:
        return "?"
    aff = threads.get("affinity") or []
    return f"{threads.get('total')} thr, cores {','.join(map(str, aff))}"


def compare_table(rows: Iterable[Mapping[str, Any]], threads: Mapping[str, Mapping[str, Any] | None]) -> str:
    """A plain-text table (ms) per prompt length; `threads`: server name -> its /server_info
    cpu_threads (prefill, decode, colocated)."""
    pd_label = f"PD (prefill {_cores(threads.get('prefill'))}; decode {_cores(threads.get('decode'))})"
    colo_label = f"colocated ({_cores(threads.get('colocated'))})"
    head = ["e2e p50", "e2e p90", "TTFT p50", "TTFT p90", "TPOT p50"]
    lines = []
    for r in rows:
        lines.append(_prompt_head(r))
        width = max(len(pd_label), len(colo_label), len("PD / colocated"))
        lines.append(" " * width + "".join(f"{h:>10}" for h in head))
        lines.append(f"{pd_label:<{width}}" + "".join(f"{_ms(r['pd'][k]):>10}" for k in COMPARE_KEYS))
        lines.append(f"{colo_label:<{width}}" + "".join(f"{_ms(r['colocated'][k]):>10}" for k in COMPARE_KEYS))
        lines.append(f"{'PD / colocated':<{width}}" + "".join(f"{_x(r['ratio'][k]):>10}" for k in COMPARE_KEYS))
    return "\n".join(lines)
