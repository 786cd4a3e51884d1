"""What every config module raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model directory or flag combination kvpipe cannot serve."""
