"""Speculative sampling keeps the target's distribution: the first emitted token follows the
target's p after the last token, and the second (emitted only after the first draft was accepted)
follows p after that draft; with filters (top-k) a draft outside the support is never accepted.
Statistical checks at five standard errors with a fixed seed."""

import math

import pytest
import torch

from kvpipe.engine.request import SamplingParams
from kvpipe.engine.sampler import Sampler, make_generator
from kvpipe.engine.spec.sampling import speculative_sample

N = 20_000


def _run(weights: torch.Tensor, drafts: list[int], seed: int = 1) -> list[tuple[list[int], int]]:
    sampler = Sampler()
    gen = make_generator(seed)
    return [
        speculative_sample(weights, drafts, lambda: sampler.uniform(gen), lambda w: sampler.draw(w, gen))
        for _ in range(N)
    ]


def _assert_follows(tokens: list[int], p: torch.Tensor, what: str) -> None:
    n = len(tokens)
    assert n > 1000, f"{what}: too few samples ({n}) to judge"
    counts = torch.bincount(torch.tensor(tokens), minlength=p.numel()).double() / n
    for t in range(p.numel()):
        pt = float(p[t])
        bound = 5 * math.sqrt(max(pt * (1 - pt), 1e-12) / n) + 1e-12
        assert abs(float(counts[t]) - pt) <= bound, f"{what}: token {t} at {float(counts[t]):.4f}, target {pt:.4f}"


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9), SamplingParams(temperature=1.3, top_k=3)])
def test_emitted_tokens_follow_the_target(params):
    logits = torch.log(torch.tensor([[0.10, 0.50, 0.20, 0.15, 0.05], [0.30, 0.05, 0.40, 0.20, 0.05], [0.2] * 5]))
    drafts = [1, 2]
    weights = Sampler().distributions(logits, [params] * 3)
    p = weights / weights.sum(dim=-1, keepdim=True)
    runs = _run(weights, drafts)
    assert all(len(toks) == acc + 1 and toks[:acc] == drafts[:acc] for toks, acc in runs)
    _assert_follows([toks[0] for toks, _ in runs], p[0], "first token")
    _assert_follows([toks[1] for toks, acc in runs if acc >= 1], p[1], "second token after an accepted draft")
    # the bonus token after both drafts were accepted: p after the second draft
    _assert_follows([toks[2] for toks, acc in runs if acc == 2], p[2], "bonus token")


def test_a_draft_outside_the_filtered_support_is_never_accepted():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.06, 0.04], [0.25] * 4]))
    weights = Sampler().distributions(logits, [SamplingParams(temperature=1.0, top_k=2)] * 2)
    assert float(weights[0, 3]) == 0.0
    runs = _run(weights, [3])
    assert all(acc == 0 and toks[0] in (0, 1) for toks, acc in runs)


def test_a_certain_draft_is_always_accepted():
    weights = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    runs = _run(weights, [1])
    assert all(acc == 1 and toks[0] == 1 for toks, acc in runs)


def test_shapes_must_agree():
    with pytest.raises(ValueError):
        speculative_sample(torch.ones(2, 4), [1, 2], lambda: 0.0, lambda w: 0)
