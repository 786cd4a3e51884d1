"""sglang-router with its keys read from files:

    python -m kvpipe.launch.router_main --api-key-file /secrets/api/admin-key \\
        --control-plane-api-keys-file /secrets/router/control-plane-keys -- ROUTER_FLAGS...

sglang-router 0.3.2 takes the key it sends its workers (`--api-key`) and its control-plane keys
(`--control-plane-api-keys 'id:name:role:key' ...`) as flags only, and every user of a machine
reads a process's flags in /proc/<pid>/cmdline. This runs the router in this process with the keys
added to the arguments it parses (sglang_router.launch_router's own parser and launcher), so the
command line names only the files: what a Kubernetes Secret mounted as files gives
(deploy/k8s/base/router.yaml).

An API-key file holds one key (its first non-comment line); a control-plane file one
`id:name:role:key` entry per line (# comments and blank lines skipped).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvpipe.config import ConfigError


def _lines(path: str, what: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: {e}") from None
    lines = [s.strip() for s in text.splitlines()]
    found = [s for s in lines if s and not s.startswith("#")]
    if not found:
        raise ConfigError(f"{what} {path} holds no key")
    return found


def router_argv(argv: Sequence[str]) -> list[str]:
    """Our flags (the files) -> the router's own arguments with the keys in them; everything after
    `--` (or every flag we do not know) goes to the router unchanged. A key given as a router flag
    as well is refused: one source per key."""
    p = argparse.ArgumentParser(prog="python -m kvpipe.launch.router_main", add_help=False, allow_abbrev=False)
    p.add_argument("--api-key-file", default=None)
    p.add_argument("--control-plane-api-keys-file", default=None)
    ours, rest = p.parse_known_args(list(argv))
    rest = rest[1:] if rest[:1] == ["--"] else rest
    out = list(rest)
    if ours.api_key_file is not None:
        if "--api-key" in rest:
            raise ConfigError("give --api-key-file or the router's --api-key, not both")
        out += ["--api-key", _lines(ours.api_key_file, "--api-key-file")[0]]
    if ours.control_plane_api_keys_file is not None:
        if "--control-plane-api-keys" in rest:
            raise ConfigError("give --control-plane-api-keys-file or the router's --control-plane-api-keys, not both")
        entries = _lines(ours.control_plane_api_keys_file, "--control-plane-api-keys-file")
        if any(len(e.split(":", 3)) != 4 for e in entries):
            raise ConfigError("--control-plane-api-keys-file: each line is id:name:role:key")
        out += ["--control-plane-api-keys", *entries]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    try:
        args = router_argv(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        raise SystemExit(f"kvpipe router: {e}") from None
    from sglang_router.launch_router import launch_router, parse_router_args  # lazy: the router extra

    launch_router(parse_router_args(args))


if __name__ == "__main__":
    main()
