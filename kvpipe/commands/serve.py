"""`kvpipe serve`: an HTTP server (SGLang native + OpenAI API), colocated or one half of a PD pair.

The engine, the server and the connectors (torch and the rest) are imported in `run`, not here:
`kvpipe serve --help` only builds the parser (tests/unit/test_cli_help.py checks it imports no torch).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpipe.commands.flags import (
    add_http_api_args,
    add_server_args,
    check_model,
    server_config_from_args,
    setup_logging,
)
from kvpipe.config import DEFAULT_MAX_REQUEST_BODY_BYTES, ConfigError, ServerConfig
from kvpipe.listen_ports import mooncake_port_env
from kvpipe.sglang_env import log_sglang_env
from kvpipe.transfer.backends.registry import check_backend

if TYPE_CHECKING:
    from kvpipe.engine.engine import Engine

logger = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    add_server_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server listens on")
    p.add_argument("--port", type=int, default=30000, help="port of the HTTP server")
    p.add_argument(
        "--worker-name",
        default=None,
        help="this server's name in its stack (e.g. prefill0, decode1), shown by `kvpipe top` and in /server_info",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="refuse request bodies larger than this with 413 (default: 32 MiB)",
    )
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=ServerConfig.graceful_shutdown_timeout_s,
        help="on SIGTERM (or Ctrl-C): seconds to finish the requests in flight while /health fails "
        "(503, draining) and new requests get 503 with Retry-After; what is left then is aborted "
        "(streams end with an error event), pages and rooms are freed, and the server exits 0. "
        "A second signal aborts at once",
    )
    add_http_api_args(p)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from kvpipe.disagg.setup import require_auth_off_loopback
    from kvpipe.server.http_server import run_server

    cfg = server_config_from_args(args)
    mode = cfg.disaggregation.mode
    try:  # before anything loads or listens
        check_backend(cfg.disaggregation, cfg.tp_size, own_process=True)
        require_auth_off_loopback(cfg, warn=False)
    except ConfigError as e:
        raise SystemExit(f"kvpipe: {e}") from None
    setup_logging(cfg.log_level)
    log_sglang_env(os.environ, logger)
    # before any transfer engine starts (TP workers inherit it): Mooncake reads its range there
    os.environ.update(mooncake_port_env(cfg))
    check_model(cfg)
    return run_server(cfg, engine_factory(cfg), mode)


def engine_factory(cfg: ServerConfig) -> Callable[[], Engine]:
    """What the server's engine thread builds: an Engine, with the PD connector of its mode."""

    from kvpipe.disagg.connectors import make_connector
    from kvpipe.engine.engine import Engine

    def build() -> Engine:
        return Engine(cfg, make_connector(cfg))

    return build
