"""The Grafana dashboard against a running PD stack (issue 29): every metric its queries name is
exposed by a part's `/metrics`, scraped where `kvpipe launch --prometheus-targets` tells Prometheus
to (prefill with layer groups, NGRAM decode, the router's exporter), and after a few requests
through the router every one of them has series, refused handshakes aside (none happened)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.launch.prometheus_targets import scrape_targets, write_targets
from tests.helpers.grafana import dashboard_metric_names, family_name
from tests.helpers.pd_stack import generate, greedy, start_stack

pytest.importorskip("mooncake.engine")

# labelled by an event this test does not cause: declared (HELP / TYPE) with no series until then
NO_SERIES_WITHOUT_EVENT = {"kvpipe_pd_handshakes_refused"}


def test_every_dashboard_metric_is_exposed(tiny_model_dir: Path, tmp_path: Path) -> None:
    stack = start_stack(
        tiny_model_dir,
        tmp_path,
        "--page-size",
        "16",
        "--chunked-prefill-size",
        "64",
        prefill_args=("--disaggregation-layer-groups", "2", "--disaggregation-layer-groups-min-tokens", "0"),
        decode_args=("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"),
    )
    try:
        # a repetitive prompt (NGRAM drafts from it), then one sharing its prefix (a prefix hit)
        prompt = [7, 19, 31, 43] * 10
        for ids in (prompt, [*prompt, 5, 6]):
            out = generate(stack.router, {"input_ids": ids, "sampling_params": greedy(12)})
            assert out["meta_info"]["completion_tokens"] == 12
        stack.decode.wait_idle()
        stack.prefill.wait_idle()

        path = tmp_path / "targets" / "kvpipe.json"
        write_targets(str(path), scrape_targets(stack.pd.metrics_urls, stack.router))
        groups = json.loads(path.read_text())
        assert {g["labels"]["part"] for g in groups} == {"prefill", "decode", "router"}

        families: dict[str, str] = {}  # family name -> type, over every part
        series: dict[str, int] = {}
        for g in groups:
            (target,) = g["targets"]
            r = httpx.get(f"http://{target}/metrics", timeout=30.0)
            assert r.status_code == 200, (g, r.text[:300])
            for fam in text_string_to_metric_families(r.text):
                assert families.setdefault(fam.name, fam.type) == fam.type, fam.name
                series[fam.name] = series.get(fam.name, 0) + len(fam.samples)

        used = dashboard_metric_names()
        resolved = {name: family_name(name, families) for name in used}
        assert {name: sorted(used[name]) for name, fam in resolved.items() if fam is None} == {}
        empty = {fam for fam in resolved.values() if fam is not None and series[fam] == 0}
        assert empty == NO_SERIES_WITHOUT_EVENT, empty
    except AssertionError:
        print(stack.logs())
        raise
    finally:
        stack.close()
