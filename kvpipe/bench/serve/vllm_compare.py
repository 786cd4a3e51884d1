"""`bench serve --compare-vllm` bookkeeping (plain Python): the concurrencies asked for, how busy the
CPU was before a round, and kvpipe's figures beside vLLM's with kvpipe/vLLM ratios, as rows and a
table. The run itself is vllm_run.py."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpipe.bench.serve.sweep import SweepPoint

# (summary key, table head, higher is better): the figures the acceptance of issue 51 names
VLLM_KEYS: tuple[tuple[str, str, bool], ...] = (
    ("output_throughput", "out tok/s", True),
    ("ttft_p50_ms", "TTFT p50", False),
    ("ttft_p90_ms", "TTFT p90", False),
    ("tpot_p50_ms", "TPOT p50", False),
    ("e2e_p50_ms", "e2e p50", False),
)
_COUNTS = ("completed", "failed", "prompt_tokens_mean")


def parse_concurrencies(spec: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]: positive, no repeats, in the order given."""
    try:
        values = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrencies: expected N,N,..., got {spec!r}") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise ValueError(f"--concurrencies: positive and without repeats, got {spec!r}")
    return values


# far from the warm-up's offset (run.warmup_config: seed + 1,000,003) for any number of concurrencies
CONCURRENCY_SEED_STRIDE = 7_919


def concurrency_seed(seed: int, index: int) -> int:
    """The workload seed of the `index`-th concurrency of a run: each concurrency sends prompts
    neither server has seen. With one seed for all, a later concurrency's prompts were an earlier
    one's, and both servers' prefix caches answered them from memory: their TTFT measured no
    prefill at all."""
    return seed + CONCURRENCY_SEED_STRIDE * index


def busy_fraction(before: Sequence[int], after: Sequence[int]) -> float:
    """Share of CPU time not idle between two /proc/stat 'cpu' lines' counters (user nice system
    idle iowait irq softirq steal ...): idle and iowait count as idle."""
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])
    if total <= 0:
        return 0.0
    idle = delta[3] + (delta[4] if len(delta) > 4 else 0)
    return max(0.0, min(1.0, 1.0 - idle / total))


def cpu_times(stat_text: str) -> list[int]:
    """The aggregate 'cpu' line of /proc/stat as integers."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            return [int(x) for x in line.split()[1:]]
    raise ValueError("no aggregate cpu line in /proc/stat")


@dataclass(frozen=True)
class RoundCheck:
    """The CPU before one round on one server: how busy, and whether it reached the threshold."""

    concurrency: int
    round: int
    mode: str
    busy: float  # the last reading before the round started
    waited_s: float
    idle: bool  # busy <= the threshold (else the round ran after the wait's timeout)

    def to_json(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "round": self.round,
            "mode": self.mode,
            "cpu_busy": round(self.busy, 3),
            "waited_s": round(self.waited_s, 2),
            "idle": self.idle,
        }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def vllm_rows(points: Mapping[int, Iterable[SweepPoint]], ours: str, theirs: str) -> list[dict[str, Any]]:
    """Per concurrency (its prompt length's points): mode `ours` (kvpipe) beside mode `theirs` (vLLM),
    and kvpipe/vLLM ratios. A concurrency where either side is missing has no row."""
    rows = []
    for c in sorted(points):
        by_mode = {(p.prompt_len, p.mode): p.summary for p in points[c]}
        for n in sorted({n for n, _ in by_mode}):
            a, b = by_mode.get((n, ours)), by_mode.get((n, theirs))
            if a is None or b is None:
                continue
            keys = [k for k, _, _ in VLLM_KEYS]
            rows.append(
                {
                    "concurrency": c,
                    "prompt_len": n,
                    "kvpipe": {k: a.get(k) for k in (*keys, *_COUNTS)},
                    theirs: {k: b.get(k) for k in (*keys, *_COUNTS)},
                    "ratio": {k: _ratio(a.get(k), b.get(k)) for k in keys},
                }
            )
    return rows


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def vllm_table(rows: Iterable[Mapping[str, Any]], theirs: str, header: Sequence[str] = ()) -> str:
    """A plain-text table: per (concurrency, prompt length) kvpipe's, vLLM's figures and their ratio
    (kvpipe/vLLM: above 1 is better for tok/s, below 1 for the latencies); `header` lines first."""
    heads = [h for _, h, _ in VLLM_KEYS]
    label_w = max(len("kvpipe / " + theirs), 14)
    lines = list(header)
    for r in rows:
        lines.append(f"concurrency {r['concurrency']}, prompt {r['prompt_len']} tokens")
        lines.append(" " * label_w + "".join(f"{h:>11}" for h in heads))
        for name in ("kvpipe", theirs):
            lines.append(f"{name:<{label_w}}" + "".join(f"{_num(r[name][k]):>11}" for k, _, _ in VLLM_KEYS))
        ratio = "".join(f"{_x(r['ratio'][k]):>11}" for k, _, _ in VLLM_KEYS)
        lines.append(f"{'kvpipe / ' + theirs:<{label_w}}" + ratio)
    return "\n".join(lines)


def verdicts(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Where kvpipe is behind (a ratio on the wrong side of 1), one line each."""
    out = []
    for r in rows:
        for k, head, higher in VLLM_KEYS:
            x = r["ratio"].get(k)
            if x is not None and (x < 1.0 if higher else x > 1.0):
                out.append(f"concurrency {r['concurrency']}: kvpipe behind on {head} ({x:.2f}x)")
    return out
