"""docs/metrics.md's table lists exactly the metrics a server's /metrics exposes (issue 29: every
metric documented in one table), for every role, and every metric the Grafana dashboard
(deploy/grafana/kvpipe.json) queries."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.server.metrics import _GAUGES, _SPEC_COUNTERS, ServerMetrics
from tests.helpers.grafana import dashboard_metric_names, family_name

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# every key the engine's stats can carry (a PD prefill's: the most; speculation is a decode's)
STATS = {
    **{k: 1 for k in _GAUGES},
    **{k: 2 for k in _SPEC_COUNTERS},
    "prefix_hit_tokens": 3,
    "generated_tokens": 7,
    "disaggregation": {
        "bytes_written": 10,
        "auth_rejected": {"control": 0, "bootstrap": 0},
        "handshakes_refused": {"page_size": 1},
    },
    "layer_group_batches": {1: 2},
    "kv_store": {
        "pages_fetched": 4,
        "pages_put": 5,
        "pages_rejected": 1,
        "fallbacks": {"down": 1},
        "puts_dropped": {"queue_full": 2},
    },
}
# a decode's with a staging ring (heterogeneous TP): its waits and live slots
DECODE_STATS = {
    **STATS,
    "disaggregation": {
        "mode": "decode",
        "auth_rejected": {"control": 0},
        "handshakes_refused": {},
        "staging_ring": {"live_slots": 1},
        "staging_waits": {"bounds": [0.001, 1.0], "counts": [3, 1, 0], "sum": 0.5},
    },
}


def stats_of(role: str) -> dict:
    return DECODE_STATS if role == "decode" else STATS


def documented() -> set[str]:
    rows = re.findall(r"^\| `(kvpipe_[\w` /]+)` \|", DOC.read_text(), re.M)
    return {name.strip("` ") for row in rows for name in row.split("/")}


def documented_families() -> dict[str, str]:
    """The table's metrics as prometheus_client's parser names their families (a counter without
    `_total`) -> their type column."""
    rows = re.findall(r"^\| `(kvpipe_[\w` /]+)` \| (\w+) \|", DOC.read_text(), re.M)
    out = {}
    for names, kind in rows:
        for name in (n.strip("` ") for n in names.split("/")):
            out[name.removesuffix("_total") if kind == "counter" else name] = kind
    return out


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_every_exposed_metric_is_documented(role: str) -> None:
    m = ServerMetrics("tiny", lambda: stats_of(role), role, worker_name=f"{role}0")
    m.on_first_token(0.1)
    m.on_tokens(0.2, 2)
    m.on_finish("length", 5, 0, 3, 0.5, 0.1)
    exposed = {
        f"{fam.name}_total" if fam.type == "counter" else fam.name
        for fam in text_string_to_metric_families(m.render().decode())
        if fam.samples and not fam.name.endswith("_created")  # the client's creation timestamps
    }
    assert exposed - documented() == set()


def test_every_documented_metric_exists() -> None:
    names: set[str] = set()
    for role in ("colocated", "prefill", "decode"):
        stats = stats_of(role)
        m = ServerMetrics("tiny", lambda: stats, role, worker_name=f"{role}0")  # noqa: B023 - rendered here
        m.on_finish("length", 5, 0, 3, 0.5, 0.1)
        names |= {
            f"{fam.name}_total" if fam.type == "counter" else fam.name
            for fam in text_string_to_metric_families(m.render().decode())
            if not fam.name.endswith("_created")
        }
    assert documented() - names == set()


def test_every_dashboard_metric_is_documented() -> None:
    """Each name a dashboard query selects (`x_bucket` of a histogram, `y_total` of a counter) is a
    sample of a metric in the table, of the type its suffix needs."""
    used = dashboard_metric_names()
    families = documented_families()
    assert {"kvpipe_pd_handshakes_refused_total", "kvpipe_spec_accepted_tokens_total"} <= used.keys()
    missing = {name: sorted(where) for name, where in used.items() if family_name(name, families) is None}
    assert missing == {}
