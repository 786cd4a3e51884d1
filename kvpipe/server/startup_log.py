"""What a server says while it starts: one "ready" line once the model has loaded *and* the socket
listens, instead of uvicorn's start-up lines (its "Uvicorn running on ..." comes before the model
loads, so it promised an answer the server could not give yet). `--log-level debug` keeps them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from kvpipe.config import ServerConfig

logger = logging.getLogger("kvpipe.server")

# uvicorn's INFO lines at start-up (uvicorn/server.py, uvicorn/lifespan/on.py)
UVICORN_START_LINES = (
    "Started server process",
    "Waiting for application startup",
    "Application startup complete",
    "Uvicorn running on",
)
ROUTER_PROBE = "Invalid HTTP request received."
LISTEN_WAIT_S = 60.0  # the engine loaded before uvicorn bound its socket: wait this long for it


class Listening(Protocol):
    started: bool  # uvicorn.Server sets it once its sockets listen


def quiet_uvicorn_start(record: logging.LogRecord) -> bool:
    """A logging filter for "uvicorn.error" (its general logger): drops the start-up lines above
    and sglang-router's HTTP/2 probe, which h11 refuses and uvicorn logs as a warning each time
    (noise, not a fault of ours or of a client)."""
    message = record.getMessage()
    return message != ROUTER_PROBE and not message.startswith(UVICORN_START_LINES)


def ready_line(cfg: ServerConfig, role: str, load_s: float) -> str:
    return f"ready: {cfg.model_name} ({role}) at http://{cfg.host}:{cfg.port}, loaded in {load_s:.1f} s"


async def announce_ready(server: Listening, cfg: ServerConfig, role: str, since: float) -> None:
    """Log the ready line once `server` listens (bounded wait; the event loop, not the engine)."""
    deadline = time.monotonic() + LISTEN_WAIT_S
    while not server.started and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if server.started:
        logger.info(ready_line(cfg, role, time.monotonic() - since))
