"""`python -m kvpipe.launch.router_main ROUTER_ARGS`: sglang-router (`sglang_router.launch_router`)
with the stack's keys from the environment instead of its command line, which every user of the
machine can read in /proc (sglang-router takes keys as flags only):

- $KVPIPE_API_KEY becomes `--api-key`: the key the router sends its workers and asks its own
  clients for on the inference routes;
- $KVPIPE_ADMIN_API_KEY becomes `--control-plane-api-keys 'kvpipe-admin:kvpipe admin:admin:KEY'`:
  the router's control plane (`POST /workers`, `GET /workers`, `/flush_cache`, ...) then needs it
  (without control-plane keys sglang-router 0.3.2 lets any holder of the user key, or anyone when
  there is none, add a worker of theirs). A control-plane key is refused on the inference routes,
  and the user key on the control plane (checked against 0.3.2).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from sglang_router.launch_router import launch_router, parse_router_args

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


def main(argv: Sequence[str] = sys.argv[1:], environ: Mapping[str, str] = os.environ) -> None:
    launch_router(parse_router_args([*argv, *key_flags(environ)]))


if __name__ == "__main__":
    main()
