"""Prompts that share prefixes, for the prefix-cache tests with PD (in-process and through the
router)."""

from __future__ import annotations

import random


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """32 prompts: 4 system prefixes (page-aligned and not) x 8 questions of 1-40 tokens."""
    rnd = random.Random(seed)
    out = []
    for plen in (16, 37, 64, 90):
        prefix = [rnd.randrange(3, 290) for _ in range(plen)]
        out += [prefix + [rnd.randrange(3, 290) for _ in range(rnd.randint(1, 40))] for _ in range(8)]
    return out
