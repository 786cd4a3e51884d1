"""Engine errors the server treats differently from a failed step."""

from __future__ import annotations


class EngineLost(RuntimeError):
    """The engine can never step again: a TP rank exited, and the group cannot re-form inside
    this process. The server exits on it at once (so a supervisor restarts it) instead of failing
    every later request while /health still answers ok; a plain step failure is retried."""
