"""`kvpipe top`'s frame: the tables it draws from the workers' views (top_stats.py).

Everything fits 80 columns, the width of a terminal that says nothing and of output without a TTY
(rich's default): no cell or header is cut. So the figures are split in tables: the rates and
latencies per worker, where each worker is and what it holds, and the TTFT components per worker
with one table per role (a prefill's and a decode's components differ). Headers wrap onto two
lines instead of widening their columns; names and numbers never wrap; a long URL folds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvpipe.commands.top_stats import COMPONENTS, Latency, WorkerView

ROLE_ORDER = ("prefill", "decode", "colocated")
# component labels as headers: two short lines each
_HEADERS = {label: label.replace(" ", "\n", 1) for label, _ in COMPONENTS}


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _of(used: float | None, total: float | None) -> str:
    return "-" if used is None or total is None else f"{used:.0f}/{total:.0f}"


def _uptime(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def _table(headers: Sequence[str], left: int = 1) -> Table:
    """A borderless table: the first `left` columns left-aligned (names), the rest right (numbers).
    Untitled: frame() prints each title as a line of its own (a table's title wraps at its width)."""
    t = Table(box=None, pad_edge=False, padding=(0, 1), expand=False)
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i < left else "right", no_wrap=True)
    return t


def ordered(views: Sequence[WorkerView]) -> list[WorkerView]:
    """Prefills, decodes, colocated servers, then anything else; by name within a role."""
    rank = {r: i for i, r in enumerate(ROLE_ORDER)}
    return sorted(views, key=lambda v: (rank.get(v.role, len(rank)), v.label, v.url))


def workers_table(views: Sequence[WorkerView]) -> Table:
    """Per worker: uptime, restarts, requests/s, generated tokens/s, TTFT and ITL, running/waiting."""
    headers = (
        "worker",
        "up",
        "restarts",
        "req/s",
        "tok/s",
        "TTFT\np50 ms",
        "TTFT\np99 ms",
        "ITL\np50 ms",
        "run/\nwait",
    )
    t = _table(headers)
    for v in ordered(views):
        name = v.label + (" (unhealthy)" if v.healthy is False else "")
        restarts = Text(str(v.restarts), style="bold red" if v.restarts else "")
        if not v.up:
            t.add_row(name, Text("DOWN", style="bold red"), restarts, *["-"] * 6)
            continue
        t.add_row(
            name,
            _uptime(v.uptime_s),
            restarts,
            _f(v.requests_per_s, "{:.2f}"),
            _f(v.tokens_per_s),
            _ms(v.ttft.p50),
            _ms(v.ttft.p99),
            _ms(v.itl.p50),
            f"{_f(v.running, '{:.0f}')}/{_f(v.waiting, '{:.0f}')}",
        )
    return t


def where_table(views: Sequence[WorkerView]) -> Table:
    """Per worker: its role and URL, the KV pages and state / staging slots it holds, its KV transfer rate."""
    t = _table(("worker", "role", "url", "pages", "slots", "KV\nGB/s"), left=3)
    t.columns[2].no_wrap, t.columns[2].overflow = False, "fold"  # a long host name folds, never cut
    for v in ordered(views):
        if not v.up:
            t.add_row(v.label, v.role, v.url, "-", "-", Text(v.error or "down", style="red"))
            continue
        slots = _of(v.state_slots_used, v.state_slots_total)
        if v.staging_slots is not None:
            slots = f"{slots} stg {v.staging_slots:.0f}" if slots != "-" else f"stg {v.staging_slots:.0f}"
        t.add_row(v.label, v.role, v.url, _of(v.pages_used, v.pages_total), slots, _f(v.transfer_gb_per_s, "{:.3g}"))
    return t


def components_tables(views: Sequence[WorkerView]) -> list[tuple[str, Table]]:
    """(title, table) of the TTFT components per worker, one table per role: mean / p99 (ms) of the
    requests that finished in the interval."""
    tables = []
    for role in sorted({v.role for v in views}, key=lambda r: (r not in ROLE_ORDER, r)):
        rows = [v for v in ordered(views) if v.role == role and v.up and v.components]
        shown = [label for label, _ in COMPONENTS if any(label in v.components for v in rows)]
        if not rows:
            continue
        t = _table(("worker", *(_HEADERS[s] for s in shown)))
        for v in rows:
            cells = [v.components.get(label, Latency()) for label in shown]
            t.add_row(v.label, *("-" if c.mean is None else f"{_ms(c.mean)}/{_ms(c.p99)}" for c in cells))
        tables.append((f"TTFT components of the {role} servers (ms, mean/p99)", t))
    return tables


def frame(views: list[WorkerView], source: str, interval_s: float, note: str | None = None) -> Group:
    up = sum(v.up for v in views)
    head = Text.assemble(
        ("kvpipe top", "bold"),
        f"  {source}  workers {up}/{len(views)} up  every {interval_s:g}s  {time.strftime('%H:%M:%S')}",
    )
    parts: list[RenderableType] = [head]
    comps = components_tables(views)
    for title, t in [("workers", workers_table(views)), ("where and what they hold", where_table(views)), *comps]:
        parts += [Text(title, style="bold"), t]
    if not comps:
        parts.append(Text("TTFT components: no request finished in the last interval"))
    if note:
        parts.append(Text(note, style="red"))
    return Group(*parts)
