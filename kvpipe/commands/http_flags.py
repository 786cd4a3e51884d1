"""Flags of the HTTP API's keys and of its listener (`serve`): who may call what
(kvpipe/server/api_key.py) and how long a client may take to send a request
(kvpipe/http_listener.py). Keys come from files or the environment, which stay out of process
lists; the flags that take a key itself exist for SGLang's `--api-key`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from kvpipe.config import ListenerLimits
from kvpipe.server.client_keys import ADMIN_API_KEY_ENV, API_KEY_ENV
from kvpipe.server.server_keys import given_keys


def add_access_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP API keys")
    g.add_argument(
        "--api-key",
        default=None,
        help=f"clients must send `Authorization: Bearer <key>` on every route but /health, "
        f"/health_generate and /metrics (401 otherwise); prefer --api-key-file or ${API_KEY_ENV}, "
        "which stay out of process lists",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        help="user keys, one per line (# comments and blank lines skipped): each key is its own user "
        "(abort by rid reaches only its own requests; --cache-salt-by-api-key)",
    )
    g.add_argument(
        "--admin-api-key",
        default=None,
        help="the key of the admin routes (/debug/*, abort_all, the addresses and paths of /server_info); "
        f"prefer --admin-api-key-file or ${ADMIN_API_KEY_ENV}. Without it nobody may use them once a user "
        "key is set (without any key the server is open)",
    )
    g.add_argument("--admin-api-key-file", default=None, help="the admin key: the file's first line")
    g.add_argument(
        "--cache-salt-by-api-key",
        action="store_true",
        help="share cached prefixes only between requests sent with the same key (a request's own "
        "cache_salt then narrows it further): another user's cached_tokens tell nothing",
    )


def access_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """ServerConfig's key fields from the flags of `add_access_args` (none for commands without them)."""
    users = given_keys(
        getattr(args, "api_key", None), getattr(args, "api_key_file", None), API_KEY_ENV, environ, "--api-key"
    )
    admin = given_keys(
        getattr(args, "admin_api_key", None),
        getattr(args, "admin_api_key_file", None),
        ADMIN_API_KEY_ENV,
        environ,
        "--admin-api-key",
    )
    return {
        "api_key": users[0] if users else None,
        "api_keys": tuple(users[1:]),
        "admin_api_key": admin[0] if admin else None,
        "cache_salt_by_api_key": bool(getattr(args, "cache_salt_by_api_key", False)),
    }


def add_listener_args(p: argparse.ArgumentParser) -> None:
    d = ListenerLimits()
    g = p.add_argument_group("HTTP listener (slow clients)")
    g.add_argument(
        "--http-header-timeout",
        type=float,
        default=d.header_timeout_s,
        help="seconds a client has to send a request's head (from connecting, or from the next request's "
        "first byte); then 408 and the connection is closed",
    )
    g.add_argument(
        "--http-body-timeout",
        type=float,
        default=d.body_timeout_s,
        help="seconds a client has to send a request's body after its head, plus one per 64 KiB it sent; "
        "then the connection is closed",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=d.keep_alive_s,
        help="seconds an idle connection stays open between requests (uvicorn's)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open client connections; one more takes the place of the one waiting longest for its client "
        "(closed, 408 in a head), or gets 503 with Retry-After at once when every one has a request in "
        "(keep it well under the process's open-file limit, `ulimit -n`)",
    )


def listener_from_args(args: argparse.Namespace) -> ListenerLimits:
    """The flags of `add_listener_args` (their defaults for commands without them)."""
    d = ListenerLimits()
    return ListenerLimits(
        header_timeout_s=getattr(args, "http_header_timeout", d.header_timeout_s),
        body_timeout_s=getattr(args, "http_body_timeout", d.body_timeout_s),
        keep_alive_s=getattr(args, "timeout_keep_alive", d.keep_alive_s),
        max_connections=getattr(args, "max_connections", d.max_connections),
    )
