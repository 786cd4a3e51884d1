"""`kvpipe launch --prometheus-targets`: the file-discovery list it writes, and the scrape config
in deploy/prometheus that reads it."""

from __future__ import annotations

import fnmatch
import json
import stat
from pathlib import Path

import pytest

from kvpipe.launch.prometheus_targets import host_port, scrape_targets, write_targets
from kvpipe.launch.stack import PDStack

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "prometheus.yml"


def stack() -> PDStack:
    s = PDStack("http://127.0.0.1:4001", "http://127.0.0.1:4002", "http://127.0.0.1:8000", 4003)
    s.router_metrics_url = "http://127.0.0.1:4004"
    return s


def test_targets_name_every_part_on_its_metrics_port(tmp_path: Path) -> None:
    s = stack()
    path = tmp_path / "new" / "kvpipe.json"  # the folder is made
    write_targets(str(path), scrape_targets(s.metrics_urls, s.router_url))
    groups = json.loads(path.read_text())
    assert groups == [
        {"targets": ["127.0.0.1:4001"], "labels": {"part": "prefill", "stack": "127.0.0.1:8000"}},
        {"targets": ["127.0.0.1:4002"], "labels": {"part": "decode", "stack": "127.0.0.1:8000"}},
        {"targets": ["127.0.0.1:4004"], "labels": {"part": "router", "stack": "127.0.0.1:8000"}},
    ]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # a Prometheus under another user reads it
    assert [p.name for p in path.parent.iterdir()] == ["kvpipe.json"]  # no temporary file left


def test_rewriting_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kvpipe.json"
    write_targets(str(path), scrape_targets({"prefill": "http://[::1]:1"}, "http://h:2"))
    write_targets(str(path), scrape_targets({"decode": "http://h:3"}, "http://h:2"))
    assert json.loads(path.read_text()) == [{"targets": ["h:3"], "labels": {"part": "decode", "stack": "h:2"}}]


def test_a_router_without_an_exporter_is_left_out() -> None:
    s = PDStack("http://a:1", "http://b:2", "http://c:3", 4)
    assert list(s.metrics_urls) == ["prefill", "decode"]


def test_host_port_needs_a_url() -> None:
    assert host_port("http://[::1]:30000/x") == "[::1]:30000"
    with pytest.raises(ValueError):
        host_port("127.0.0.1:30000")


def test_scrape_config_reads_the_targets_the_docs_write() -> None:
    """deploy/prometheus/prometheus.yml's file discovery matches the path docs/metrics.md gives
    `--prometheus-targets` (relative to the config's folder, as Prometheus resolves it)."""
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load(CONFIG.read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "kvpipe"]
    (sd,) = job["file_sd_configs"]
    doc = (CONFIG.parents[2] / "docs" / "metrics.md").read_text()
    written = "deploy/prometheus/targets/kvpipe.json"
    assert f"--prometheus-targets {written}" in doc
    assert any(fnmatch.fnmatch(written, f"deploy/prometheus/{pattern}") for pattern in sd["files"])
