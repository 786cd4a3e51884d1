"""Mooncake's start-up lines, kept out of a server's log unless it runs with `--log-level debug`.

The transfer engine logs through glog straight to file descriptor 2, below Python's logging.
MC_LOG_LEVEL (set by kvpipe/commands/flags.py `setup_logging`: ERROR, or INFO with debug) hides
its INFO and WARNING lines ("No RDMA devices found", "Using default malloc/free"), but two lines
of every start pass any level: glog's "Logging before InitGoogleLogging()" banner and the
error-level "Local segment descriptor not found" that `initialize` logs before it publishes the
descriptor itself. `quiet_start` captures fd 2 while the engine starts and hands those known lines
to the debug log; anything else written meanwhile (another thread's log, a real error) goes back
to fd 2 unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Mapping

logger = logging.getLogger(__name__)

# glog's own banner, and the level-and-timestamp prefix of its lines ("E1201 03:11:49.462404 15248 file.cpp:1098] ")
_BANNER = "WARNING: Logging before InitGoogleLogging() is written to STDERR"
_GLOG = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] (?P<message>.*)$")
START_NOISE = (  # what every TCP start says, by message prefix
    "Local segment descriptor not found",
    "No RDMA devices found",
    "Using default malloc/free for protocol",
)
VERBOSE_LEVELS = ("TRACE", "INFO")  # MC_LOG_LEVEL values under which nothing is hidden


def is_start_noise(line: str) -> bool:
    if line.strip() == _BANNER:
        return True
    m = _GLOG.match(line.strip())
    return m is not None and m["message"].startswith(START_NOISE)


@contextlib.contextmanager
def quiet_start(environ: Mapping[str, str] = os.environ) -> Iterator[None]:
    """Capture fd 2 for the block (an engine's construction and `initialize`), unless MC_LOG_LEVEL
    asks for Mooncake's chatter; then start-up noise goes to the debug log, the rest back to fd 2."""
    if environ.get("MC_LOG_LEVEL", "").upper() in VERBOSE_LEVELS:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        saved = os.dup(2)
        try:
            os.dup2(capture.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            _replay(capture.read().decode("utf-8", errors="replace"))


def _replay(text: str) -> None:
    for line in text.splitlines(keepends=True):
        if is_start_noise(line):
            logger.debug("mooncake: %s", line.rstrip())
        else:
            os.write(2, line.encode())
