"""deploy/grafana/kvpipe.json is a well-formed dashboard whose every query selects a metric (the
names it selects are checked against docs/metrics.md in test_metrics_doc.py and against a running
stack's /metrics in tests/integration/test_grafana_dashboard.py)."""

from __future__ import annotations

from tests.helpers.grafana import load, metric_names, panels, queries


def test_metric_names_of_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, role) (rate(a_bucket{job=~"$job", x="by(y)"}[$__rate_interval])))'
        " / on (instance) group_left (z) b_total offset 1h5m + 1e9 * sum(c) without (d) - 2 * e"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "e"}


def test_every_query_selects_a_metric_of_kvpipe() -> None:
    qs = list(queries(load()))
    assert len(qs) > 20
    for where, expr in qs:
        names = metric_names(expr)
        assert names and all(n.startswith("kvpipe_") for n in names), (where, expr, names)


def test_panels_use_the_datasource_variable_and_unique_ids() -> None:
    dash = load()
    assert [v["name"] for v in dash["templating"]["list"]][0] == "datasource"
    ps = list(panels(dash))
    assert len({p["id"] for p in ps}) == len(ps)
    for p in ps:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in panels(load()):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (p["title"], cells.get((x, y)))
                cells[(x, y)] = p["title"]
