"""Helpers of the engine tests of the MTP-style drafters (NEXTN on DeepSeek-V3 and Qwen3.5,
EAGLE): record every draft chain the engine's drafter proposes, and compare the chains with the
ones a from-scratch reference computes for the same tokens."""

from __future__ import annotations

from typing import Protocol

from kvpipe.engine.engine import Engine
from kvpipe.engine.request import Req

Seen = list[tuple[list[int], list[int]]]  # (the request's tokens, the drafts proposed after them)


class DraftReference(Protocol):
    def drafts(self, tokens: list[int], k: int) -> list[tuple[int, float, float]]:
        """The k drafts after `tokens`, computed with nothing kept: (token, top-1 minus top-2
        logit margin, the logits' tolerance) each."""
        ...


def record_drafts(eng: Engine) -> Seen:
    """Every proposal the engine's drafter makes from now on: (the request's tokens, drafts)."""
    seen: Seen = []
    drafter = eng.scheduler.drafter
    assert drafter is not None

    def spy(req: Req, k: int) -> list[int]:
        drafts = drafter(req, k)
        seen.append((list(req.all_ids), list(drafts)))
        return drafts

    eng.scheduler.drafter = spy
    return seen


def assert_drafts_from_scratch(seen: Seen, ref: DraftReference) -> int:
    """Each recorded chain equals the from-scratch one, draft by draft, up to a draft whose
    reference margin is within the logits' tolerance (a near tie: rounding may pick either);
    returns the drafts compared."""
    compared = 0
    for tokens, drafts in seen:
        for j, (d, (want, margin, atol)) in enumerate(zip(drafts, ref.drafts(tokens, len(drafts)))):
            if margin <= 2 * atol:
                break
            assert d == want, f"draft {j} after {len(tokens)} tokens: {d}, from scratch {want} (margin {margin:.3g})"
            compared += 1
    return compared
