"""What the benchmark asks a running server: its layer-group count, transfer counters, its model's config.

The parsers are pure; the fetchers are plain sync httpx (run them through `Endpoint.call` so they
work from inside a testbed namespace).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.loader import read_hf_config
from kvpipe.server.client_keys import client_headers


@dataclass(frozen=True)
class TransferCount:
    """KV bytes a prefill wrote and rooms that succeeded (a delta between two readings)."""

    bytes_written: int
    rooms: int

    def __add__(self, other: TransferCount) -> TransferCount:
        return TransferCount(self.bytes_written + other.bytes_written, self.rooms + other.rooms)

    @property
    def per_room(self) -> float | None:
        return self.bytes_written / self.rooms if self.rooms > 0 else None


# Names under which a prefill server may report the layer-group count of its last batch:
# keys of /server_info (top level or any `internal_states` entry) and Prometheus gauge names
# (any prefix, e.g. `kvpipe:num_layer_groups`).
NUM_GROUPS_KEYS = ("num_groups", "last_num_groups", "num_layer_groups", "layer_groups")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def _as_groups(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return int(v) if v >= 1 and v == int(v) else None


def num_groups_from_server_info(info: Mapping[str, Any]) -> int | None:
    for scope in _scopes(info):
        for key in NUM_GROUPS_KEYS:
            g = _as_groups(scope.get(key))
            if g is not None:
                return g
    return None


def num_groups_from_metrics(text: str) -> int | None:
    """The last sample of a gauge whose name ends in one of NUM_GROUPS_KEYS (histogram/summary
    series `_bucket`, `_sum`, `_count` are not group counts and are skipped)."""
    found = None
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m.group(1).endswith(NUM_GROUPS_KEYS):
            continue
        try:
            g = _as_groups(float(m.group(3)))
        except ValueError:
            continue
        found = g if g is not None else found
    return found


def read_num_groups(info_url: str, timeout_s: float = 5.0) -> int | None:
    """From `info_url`'s /server_info, else its /metrics; None when the server reports neither."""
    base = info_url.rstrip("/")
    try:
        r = httpx.get(base + "/server_info", timeout=timeout_s, headers=client_headers(url=base, admin=True))
        if r.status_code == 200:
            g = num_groups_from_server_info(r.json())
            if g is not None:
                return g
        r = httpx.get(base + "/metrics", timeout=timeout_s)  # open, as for Prometheus
        if r.status_code == 200:
            return num_groups_from_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        pass
    return None


def transfer_tail_from_server_info(info: Mapping[str, Any]) -> tuple[float, int] | None:
    """(sum of ms, rooms) of a prefill's transfer tails: how long each room's KV kept landing
    after its prefill forward ended (kvpipe/disagg/layer_pipeline.py); None if not reported."""
    for scope in _scopes(info):
        total, count = scope.get("transfer_tail_ms_sum"), scope.get("transfer_tail_count")
        if isinstance(total, (int, float)) and isinstance(count, int) and not isinstance(count, bool):
            return float(total), count
    return None


def _scopes(info: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The server info and each of its internal_states (SGLang puts engine stats there)."""
    states = info.get("internal_states")
    return [info, *(s for s in states if isinstance(s, Mapping))] if isinstance(states, list) else [info]


def transfer_count_from_server_info(info: Mapping[str, Any]) -> TransferCount | None:
    """A prefill's KV bytes written and rooms that succeeded so far; None if not reported."""
    for scope in _scopes(info):
        d = scope.get("disaggregation")
        if isinstance(d, Mapping) and d.get("mode") == "prefill":
            n, rooms = d.get("bytes_written"), d.get("rooms_succeeded")
            if isinstance(n, int) and isinstance(rooms, int):
                return TransferCount(n, rooms)
    return None


# the layer-group planner's estimates at its last choice (`layer_groups` under a prefill's
# `disaggregation` stats), in ms
PLANNER_KEYS = ("compute_ms", "transfer_ms", "predicted_ms")


def layer_group_estimates_from_server_info(info: Mapping[str, Any]) -> dict[str, float]:
    """A prefill's planner estimates (PLANNER_KEYS that are numbers); empty where not reported."""
    for scope in _scopes(info):
        d = scope.get("disaggregation")
        lg = d.get("layer_groups") if isinstance(d, Mapping) else None
        if isinstance(lg, Mapping):
            return {k: float(lg[k]) for k in PLANNER_KEYS if isinstance(lg.get(k), (int, float))}
    return {}


def count_delta(before: TransferCount | None, after: TransferCount | None) -> TransferCount | None:
    if before is None or after is None:
        return None
    return TransferCount(after.bytes_written - before.bytes_written, after.rooms - before.rooms)


def read_server_info(info_url: str, timeout_s: float = 5.0) -> Mapping[str, Any] | None:
    """A server's /server_info (None when unreachable or not JSON): parse it with the
    *_from_server_info functions, one fetch for every figure of a reading."""
    try:
        r = httpx.get(
            info_url.rstrip("/") + "/server_info", timeout=timeout_s, headers=client_headers(url=info_url, admin=True)
        )
        info = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return info if isinstance(info, Mapping) else None


def engine_stats(url: str) -> Mapping[str, Any] | None:
    """The engine's stats in a server's /server_info (`internal_states[0]`); None when unreachable."""
    states = (read_server_info(url) or {}).get("internal_states")
    return states[0] if isinstance(states, list) and states and isinstance(states[0], Mapping) else None


def tail_delta(before: tuple[float, int] | None, after: tuple[float, int] | None) -> float | None:
    """Mean transfer tail (ms) of the rooms that finished between two readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def model_config(model_path: str | Path) -> dict[str, Any] | None:
    """config.json of a local checkpoint directory (or the same dict from a GGUF file), or None."""
    try:
        return read_hf_config(model_path)
    except (OSError, ValueError, ConfigError):
        return None


def server_model_path(url: str, timeout_s: float = 5.0) -> str | None:
    """The local checkpoint a server (or the router in front of it) reports: kvpipe's
    `checkpoint_path` (a directory or a .gguf file), else SGLang's `model_path` (a directory)."""
    return _server_path(url, ("checkpoint_path", "model_path"), timeout_s)


def server_tokenizer_path(url: str, timeout_s: float = 5.0) -> str | None:
    """Where the tokenizer a server reports lives: its `tokenizer_path` (a local directory), else
    its checkpoint (a .gguf file holds its tokenizer)."""
    return _server_path(url, ("tokenizer_path", "checkpoint_path", "model_path"), timeout_s)


def _server_path(url: str, keys: tuple[str, ...], timeout_s: float) -> str | None:
    """The first of `keys` a server's model/server info holds (the first info that holds any)."""
    base = url.rstrip("/")
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        try:
            r = httpx.get(base + path, timeout=timeout_s, headers=client_headers(url=base, admin=True))
            info = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(info, dict):
            found = next((info[k] for k in keys if info.get(k)), None)
            if found:
                return str(found)
    return None


def read_debug_requests(url: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """A server's /debug/requests entries, oldest first ([] when it keeps none or cannot say)."""
    try:
        r = httpx.get(
            url.rstrip("/") + "/debug/requests", timeout=timeout_s, headers=client_headers(url=url, admin=True)
        )
        body = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return []
    entries = body.get("requests") if isinstance(body, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
