"""docs/metrics.md's table lists exactly the metrics a server's /metrics exposes (issue 29: every
metric documented in one table), for every role."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.server.metrics import _GAUGES, ServerMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# every key the engine's stats can carry (a PD prefill's: the most)
STATS = {
    **{k: 1 for k in _GAUGES},
    "prefix_hit_tokens": 3,
    "disaggregation": {"bytes_written": 10, "auth_rejected": {"control": 0, "bootstrap": 0}},
    "layer_group_batches": {1: 2},
}


def documented() -> set[str]:
    rows = re.findall(r"^\| `(kvpipe_[\w` /]+)` \|", DOC.read_text(), re.M)
    return {name.strip("` ") for row in rows for name in row.split("/")}


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_every_exposed_metric_is_documented(role: str) -> None:
    m = ServerMetrics("tiny", lambda: STATS, role)
    m.on_first_token(0.1)
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
        m = ServerMetrics("tiny", lambda: STATS, role)
        m.on_finish("length", 5, 0, 3, 0.5, 0.1)
        names |= {
            f"{fam.name}_total" if fam.type == "counter" else fam.name
            for fam in text_string_to_metric_families(m.render().decode())
            if not fam.name.endswith("_created")
        }
    assert documented() - names == set()
