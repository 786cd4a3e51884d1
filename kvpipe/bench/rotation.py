"""Variant rotation: round r runs the variants (modes, transfer patterns) starting from the r-th, so
each goes first as often as the others and a shared machine's load drift hits all of them alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], r: int) -> list[T]:
    """`items` rotated left by r (mod their count): [2, 0, 1] -> round 1 gives [0, 1, 2]."""
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]
