"""The HTTP listener's settings (issue 45, finding 7) from flags to uvicorn's config, without a
server (tests/integration/test_server_slow_clients.py runs the slowloris attacks)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import uvicorn

from kvpipe.commands.flags import add_http_api_args, add_server_args, server_config_from_args
from kvpipe.config import ConfigError, ListenerLimits
from kvpipe.http_listener import GuardedH11Protocol, listener_settings


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_args(p)
    add_http_api_args(p)
    return p.parse_args(argv)


def test_flags(tiny_model_dir: Path) -> None:
    base = ["--model-path", str(tiny_model_dir)]
    assert server_config_from_args(_parse(base)).listener == ListenerLimits()
    argv = ["--http-header-timeout", "2.5", "--http-body-timeout", "7", "--timeout-keep-alive", "1"]
    cfg = server_config_from_args(_parse([*base, *argv, "--max-connections", "9"]))
    assert cfg.listener == ListenerLimits(header_timeout_s=2.5, body_timeout_s=7, keep_alive_s=1, max_connections=9)
    for bad in (["--http-header-timeout", "0"], ["--max-connections", "0"], ["--timeout-keep-alive", "-1"]):
        with pytest.raises(SystemExit, match="must be a positive number|whole number >= 1"):
            server_config_from_args(_parse([*base, *bad]))


def test_limits_are_checked() -> None:
    with pytest.raises(ConfigError, match="body_timeout_s"):
        ListenerLimits(body_timeout_s=float("nan"))
    with pytest.raises(ConfigError, match="max_connections"):
        ListenerLimits(max_connections=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_header_bytes"):
        ListenerLimits(max_header_bytes=0)


def test_uvicorn_gets_the_guarded_protocol() -> None:
    limits = ListenerLimits(header_timeout_s=2, max_connections=3, keep_alive_s=4)
    config = uvicorn.Config(app=lambda *a: None, **listener_settings(limits))
    config.load()
    protocol = config.http_protocol_class
    assert isinstance(protocol, type) and issubclass(protocol, GuardedH11Protocol)
    assert protocol.limits is limits and GuardedH11Protocol.limits == ListenerLimits()  # no class shared
    assert config.timeout_keep_alive == 4 and config.limit_concurrency is None
    assert config.backlog == 3 and config.h11_max_incomplete_event_size == 16 << 10


def test_the_bootstrap_server_uses_the_same_listener() -> None:
    """One listener, one policy for both servers: the bootstrap server's limits are ListenerLimits too."""
    from kvpipe.transfer.control.bootstrap import BOOTSTRAP_LISTENER_LIMITS, BootstrapServer

    srv = BootstrapServer("127.0.0.1", 0)
    try:
        config = srv._server.config
        config.load()
        protocol = config.http_protocol_class
        assert isinstance(protocol, type) and issubclass(protocol, GuardedH11Protocol)
        assert protocol.limits is BOOTSTRAP_LISTENER_LIMITS
    finally:
        srv._sock.close()
