"""The repo's Grafana dashboard (deploy/grafana/kvpipe.json) and the metric names its PromQL
queries use, for the checks that every one is documented and exposed (issue 29)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvpipe.json"

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# PromQL words that are not metric names where they stand without a "(" after them
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"})
_KEYWORDS |= {"offset", "inf", "nan"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for p in dash.get("panels", []):
        yield p
        yield from p.get("panels", [])


def queries(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (`label_values(SERIES,
    label)` gives SERIES: the label is no metric)."""
    for p in panels(dash):
        for t in p.get("targets", []):
            if t.get("expr"):
                yield f"panel {p['title']!r} {t['refId']}", t["expr"]
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", q)
        yield f"variable {v['name']!r}", m.group(1) if m else q


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects, as written (`x_bucket`, `y_total`).

    PromQL has no Python parser here, so this removes what is not a name: string literals (label
    values, Grafana variables in them), label matchers `{...}`, range and subquery brackets
    `[...]`, Grafana variables, grouping clauses (`by (...)`, `on (...)`, ...) and numbers; of
    the identifiers left, those followed by `(` are functions and the rest, keywords aside, are
    metric names."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', "", expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"(?<![\w:])(?:\d+(?:ms|[smhdwy]))+(?![\w:])", " ", s)  # durations (offset 5m)
    s = re.sub(r"(?<![\w:])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?", " ", s)  # 0.99, 1e9
    names = set()
    for m in _IDENT.finditer(s):
        if s[m.end() :].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def dashboard_metric_names(dash: dict[str, Any] | None = None) -> dict[str, set[str]]:
    """Metric name -> where the dashboard uses it."""
    out: dict[str, set[str]] = {}
    for where, expr in queries(dash or load()):
        for name in metric_names(expr):
            out.setdefault(name, set()).add(where)
    return out


def family_name(sample_name: str, families: dict[str, str]) -> str | None:
    """The exposed family (name -> type, as prometheus_client's parser names them: a counter
    without `_total`) that a sample name of a query belongs to, or None."""
    if families.get(sample_name) in ("gauge", "untyped"):
        return sample_name
    if sample_name.endswith("_total") and families.get(sample_name[: -len("_total")]) == "counter":
        return sample_name[: -len("_total")]
    for suffix in HISTOGRAM_SUFFIXES:
        base = sample_name[: -len(suffix)]
        if sample_name.endswith(suffix) and families.get(base) == "histogram":
            return base
    return None
