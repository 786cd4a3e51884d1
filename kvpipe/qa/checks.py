"""A named pass/fail check with the measured value, and the verdict over a list of them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str  # measured value against the bound, for people


def verdict(checks: Iterable[Check]) -> bool:
    return all(c.ok for c in checks)


def checks_dict(checks: Sequence[Check]) -> list[dict[str, Any]]:
    return [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks]


def failed(checks: Iterable[Check]) -> list[str]:
    """'name: detail' of each failed check."""
    return [f"{c.name}: {c.detail}" for c in checks if not c.ok]
