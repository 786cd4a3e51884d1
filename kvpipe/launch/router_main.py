"""sglang-router with its keys kept off its command line:

    python -m kvpipe.launch.router_main [--api-key-file F] [--control-plane-api-keys-file F] -- ROUTER_FLAGS...

sglang-router 0.3.2 takes the key it sends its workers (`--api-key`) and its control-plane keys
(`--control-plane-api-keys 'id:name:role:key' ...`) as flags only, and every user of a machine
reads a process's flags in /proc/<pid>/cmdline. This runs the router in this process with the keys
added to the arguments it parses (sglang_router.launch_router's own parser and launcher). The keys
come from one of two places:

- files named on the command line: what a Kubernetes Secret mounted as files gives
  (deploy/k8s/base/router.yaml). An API-key file holds one key (its first non-comment line); a
  control-plane file one `id:name:role:key` entry per line (# comments and blank lines skipped);
- the environment, which `kvpipe launch` sets (StackSecrets.router_env): $KVPIPE_API_KEY becomes
  `--api-key`, $KVPIPE_ADMIN_API_KEY the control-plane entry `kvpipe-admin:kvpipe admin:admin:KEY`.
  Without control-plane keys sglang-router 0.3.2 lets any holder of the user key (or anyone when
  there is none) add a worker of theirs with `POST /workers`; a control-plane key is refused on the
  inference routes, and the user key on the control plane (checked against 0.3.2).

One source per key: a file and a router flag for the same key are refused; the environment fills
only a key no file or flag gave.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvpipe.config import ConfigError
from kvpipe.server.client_keys import ADMIN_API_KEY_ENV, API_KEY_ENV

CONTROL_PLANE_KEY_ID = "kvpipe-admin"


def key_flags(environ: Mapping[str, str]) -> list[str]:
    """sglang-router's flags for the keys in `environ`."""
    flags: list[str] = []
    if environ.get(API_KEY_ENV):
        flags += ["--api-key", environ[API_KEY_ENV]]
    if environ.get(ADMIN_API_KEY_ENV):
        flags += ["--control-plane-api-keys", f"{CONTROL_PLANE_KEY_ID}:kvpipe admin:admin:{environ[ADMIN_API_KEY_ENV]}"]
    return flags


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


def _file_flags(ours: argparse.Namespace, rest: Sequence[str]) -> list[str]:
    out: list[str] = []
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


def router_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Our flags (the files) -> the router's own arguments with the keys in them; everything after
    `--` (or every flag we do not know) goes to the router unchanged; then the keys `environ` holds
    for whichever of the two no file or flag gave."""
    p = argparse.ArgumentParser(prog="python -m kvpipe.launch.router_main", add_help=False, allow_abbrev=False)
    p.add_argument("--api-key-file", default=None)
    p.add_argument("--control-plane-api-keys-file", default=None)
    ours, rest = p.parse_known_args(list(argv))
    rest = rest[1:] if rest[:1] == ["--"] else rest
    out = [*rest, *_file_flags(ours, rest)]
    env_flags = key_flags(environ or {})
    for flag in ("--api-key", "--control-plane-api-keys"):
        if flag in env_flags and flag not in out:
            i = env_flags.index(flag)
            out += env_flags[i : i + 2]
    return out


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> None:
    try:
        args = router_argv(sys.argv[1:] if argv is None else argv, environ)
    except ConfigError as e:
        raise SystemExit(f"kvpipe router: {e}") from None
    from sglang_router.launch_router import launch_router, parse_router_args  # lazy: the router extra

    parsed = parse_router_args(args)
    # launch_router logs "Error starting router: ..." and re-raises: a traceback for a port in use.
    # One line instead, with the cause (the launcher names the part that exited).
    logging.getLogger("router").disabled = True  # sglang_router.launch_router's logger
    try:
        launch_router(parsed)
    except Exception as e:  # noqa: BLE001 - the router's own errors are RuntimeError, its setup's others
        raise SystemExit(f"kvpipe router: cannot start: {e}") from None


if __name__ == "__main__":
    main()
