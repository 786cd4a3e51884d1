"""Prometheus file-based service discovery for a `kvpipe launch` stack (issue 29).

`launch` picks free ports for the prefill, the decode and the router's exporter, so a static scrape
config cannot name them: `kvpipe launch --prometheus-targets PATH` writes the stack's targets as a
`file_sd_configs` file instead, which Prometheus re-reads when it changes (no reload; a relaunch on
new ports is picked up), e.g. by deploy/prometheus/prometheus.yml. Each target is labelled with its
`part` (prefill, decode, router: kvpipe's metrics carry `role` themselves, which a target label of
that name would shadow) and the `stack` (the router's address clients use).
"""

from __future__ import annotations

import json
import os
import tempfile
from urllib.parse import urlsplit


def host_port(url: str) -> str:
    """`http://127.0.0.1:30000` -> `127.0.0.1:30000` (what a Prometheus target is)."""
    netloc = urlsplit(url).netloc
    if not netloc:
        raise ValueError(f"not a URL with a host: {url!r}")
    return netloc


def scrape_targets(parts: dict[str, str], stack: str) -> list[dict[str, object]]:
    """One file_sd target group per part: `parts` maps a part's name to its metrics base URL
    (`/metrics` is Prometheus' default path); `stack` is the router's URL."""
    return [
        {"targets": [host_port(url)], "labels": {"part": part, "stack": host_port(stack)}}
        for part, url in parts.items()
    ]


def write_targets(path: str, groups: list[dict[str, object]]) -> None:
    """Write `groups` to `path` at once (a temporary file renamed over it): Prometheus watches the
    file and must never read half of it."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kvpipe-targets-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(groups, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from a Prometheus under another user
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
