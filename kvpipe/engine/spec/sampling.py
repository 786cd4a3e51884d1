"""Speculative sampling for requests with temperature > 0 whose drafts come from a deterministic
drafter (NGRAM), so that every emitted token is distributed exactly as the target model samples it.

The speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) accepts a draft d drawn
from q with probability min(1, p(d) / q(d)) and otherwise draws from norm(max(0, p - q)). A
deterministic drafter's q is a point mass at d, so the rule becomes: accept d with probability
p(d); otherwise draw from p with d removed. Then P(token t) = p(d) [t = d] + (1 - p(d)) p(t) /
(1 - p(d)) [t != d] = p(t). After every draft is accepted the bonus token is drawn from p at the
position after the last draft. p is the distribution the sampler draws from (temperature, top-k,
top-p, min-p applied: Sampler.distributions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def speculative_sample(
    weights: torch.Tensor,
    drafts: Sequence[int],
    uniform: Callable[[], float],
    draw: Callable[[torch.Tensor], int],
) -> tuple[list[int], int]:
    """weights [k + 1, V]: the target's unnormalised distribution after the last token and after
    each of the k drafts. Returns (tokens to emit: the accepted drafts then one drawn token, drafts
    accepted). `uniform()` is one U[0, 1) draw and `draw(w)` one token from weights w [V], both
    from the request's random stream."""
    if weights.shape[0] != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} distributions, got {weights.shape[0]}")
    p = weights / weights.sum(dim=-1, keepdim=True)
    out: list[int] = []
    for j, d in enumerate(drafts):
        if uniform() < float(p[j, d]):
            out.append(int(d))
            continue
        residual = p[j].clone()
        residual[d] = 0.0  # p(d) < 1 here (a uniform draw is below 1), so something is left
        out.append(draw(residual))
        return out, j
    out.append(draw(p[len(drafts)]))
    return out, len(drafts)
