"""Helpers of the engine tests of the MTP-style drafters (NEXTN on DeepSeek-V3 and Qwen3.5,
EAGLE): record every draft chain the engine's drafter proposes, compute a chain from scratch
given the target's hidden states, and compare the recorded chains with the from-scratch ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import Req
from kvpipe.model.forward_batch import ForwardBatch
from tests.helpers.tolerance import logit_atol

# an MTP layer or EAGLE head: (hidden [T, H], batch, its one-layer pool) -> (its output [T, H], logits [B, V])
Drafter = Callable[[torch.Tensor, ForwardBatch, KVPool], tuple[torch.Tensor, torch.Tensor]]

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


@dataclass(frozen=True)
class DraftShape:
    """What logit_atol needs: the target's layers plus the drafter's one, and the hidden size."""

    num_layers: int
    hidden_size: int


def pick(logits: torch.Tensor, shape: DraftShape, positions: int) -> tuple[int, float, float]:
    """The greedy draft of one row of logits [V]: (token, top-1 minus top-2 margin, tolerance)."""
    top = torch.topk(logits, 2)
    return int(top.indices[0]), float(top.values[0] - top.values[1]), logit_atol(logits, shape, positions)


@torch.inference_mode()
def chain_from_scratch(
    drafter: Drafter,
    pool: KVPool,
    hidden: torch.Tensor,
    tokens: list[int],
    k: int,
    table: torch.Tensor,
    page_size: int,
    shape: DraftShape,
) -> list[tuple[int, float, float]]:
    """The k drafts after t_0 .. t_{n-1}, given the target's final-norm hidden states h_0 ..
    h_{n-2} [n - 1, H]: the drafter over (h_i, t_{i+1}) for every position in one extend into an
    empty `pool` (pages `table`), then the chain one token at a time feeding its own output
    forward. Each draft comes with its margin and the logits' tolerance (`pick`)."""
    n = len(tokens)
    fb = ForwardBatch.build([tokens[1:]], [0], [table], page_size)
    out, logits = drafter(hidden, fb, pool)
    got = [pick(logits[0], shape, n)]
    h = out[-1:]
    while len(got) < k:
        fb = ForwardBatch.build([[got[-1][0]]], [n - 2 + len(got)], [table], page_size)
        h, logits = drafter(h, fb, pool)
        got.append(pick(logits[0], shape, n + len(got)))
    return got
