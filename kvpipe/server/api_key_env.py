"""Where kvpipe's API keys come from outside the command line, and what its own clients send.

Apart from kvpipe/server/api_key.py (the server's check, which needs starlette) so that the flag
parsers (kvpipe/commands/http_flags.py) and the clients import no web framework.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY_ENV = "KVPIPE_API_KEY"  # read when --api-key is not given: it stays out of process lists
ADMIN_API_KEY_ENV = "KVPIPE_ADMIN_API_KEY"  # likewise for --admin-api-key


def api_key_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    return environ.get(API_KEY_ENV) or None


def client_headers(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What kvpipe's own clients (bench, soak, chaos, chat, top) send: `Authorization: Bearer
    <key>` with KVPIPE_ADMIN_API_KEY when set (they read /debug/requests and the full
    /server_info), else KVPIPE_API_KEY, else nothing."""
    key = environ.get(ADMIN_API_KEY_ENV) or api_key_from_env(environ)
    return {"Authorization": f"Bearer {key}"} if key else {}
