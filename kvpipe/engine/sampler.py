"""Batched sampling from fp32 logits with per-request temperature, top-k, top-p, min-p and seed.

Filtering is vectorised over the batch; the random draw is per row with that row's own
torch.Generator, so a seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpipe.engine.request import Req, SamplingParams


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]  # log_softmax of the raw (untempered, unfiltered) logits at the token


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


class RequestGenerators:
    """Seeded requests' private RNG streams (unseeded ones draw from the sampler's default)."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = device
        self._by_rid: dict[str, torch.Generator] = {}

    def get(self, req: Req) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        g = self._by_rid.get(req.rid)
        if g is None:
            g = self._by_rid[req.rid] = make_generator(req.params.seed, self.device)
        return g

    def forget(self, rid: str) -> None:
        self._by_rid.pop(rid, None)


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        # draws of unseeded requests come from this one stream (reproducible per engine run)
        self.default_generator = make_generator(seed, self.device)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> SampleOutput:
        """logits: [B, V] float32. generators[i] (None: the sampler's default) drives row i."""
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} requests")
        logits = logits.float()
        bsz = logits.shape[0]
        if bsz == 0:
            return SampleOutput([], [])
        gens = list(generators) if generators is not None else [None] * bsz
        logp_all = torch.log_softmax(logits, dim=-1)  # [B, V]
        tokens = torch.argmax(logits, dim=-1)  # [B]; the answer for greedy rows
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            sel = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            sampled = self._sample_rows(logits[sel], [params[i] for i in rows], [gens[i] for i in rows])
            tokens[sel] = sampled
        lp = logp_all.gather(1, tokens[:, None])[:, 0]
        return SampleOutput(tokens.tolist(), lp.tolist())

    def _sample_rows(
        self, logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits: [R, V] of non-greedy rows -> [R] sampled token ids."""
        r = logits.shape[0]
        probs, filtered = _tempered(logits, params)
        if filtered is None:  # no filter: draw from the full distribution, no sort needed
            return torch.stack([self._draw(probs[i], gens[i]) for i in range(r)])
        sorted_p, order = filtered
        picked = torch.stack([self._draw(sorted_p[i], gens[i]) for i in range(r)])  # [R] sorted positions
        return order.gather(1, picked[:, None])[:, 0]

    def distributions(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """logits [R, V] of non-greedy rows -> the (unnormalised) distributions _sample_rows draws
        from, in vocabulary order [R, V]: tempered, with top-k, top-p and min-p applied."""
        probs, filtered = _tempered(logits.float(), list(params))
        if filtered is None:
            return probs
        sorted_p, order = filtered
        return torch.zeros_like(probs).scatter_(1, order, sorted_p)

    def _draw(self, weights: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """One index from unnormalised non-negative weights [V]."""
        return torch.multinomial(weights, 1, generator=gen or self.default_generator)[0]

    def draw(self, weights: torch.Tensor, gen: torch.Generator | None) -> int:
        """One token id from unnormalised non-negative weights [V], from `gen`'s stream."""
        return int(self._draw(weights, gen))

    def uniform(self, gen: torch.Generator | None) -> float:
        """One draw from U[0, 1) of `gen`'s stream (None: the sampler's default)."""
        g = gen or self.default_generator
        return float(torch.rand(1, generator=g, device=g.device)[0])


def _tempered(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """softmax(logits / temperature) [R, V], and when any filter applies the filtered
    distribution sorted by probability with its order ([R, V] each); None: no filter."""
    vocab = logits.shape[1]
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    probs = torch.softmax(logits / temps[:, None], dim=-1)  # [R, V]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    min_ps = [p.min_p for p in params]
    if all(k == vocab for k in top_ks) and all(p >= 1.0 for p in top_ps) and all(m <= 0 for m in min_ps):
        return probs, None
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [R, V]
    # mass before each entry; an entry is kept while the mass before it is <= top_p
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    rank = torch.arange(vocab, device=dev)[None, :]
    k_t = torch.tensor(top_ks, device=dev)[:, None]
    p_t = torch.tensor(top_ps, dtype=torch.float32, device=dev)[:, None]
    minp_t = torch.tensor(min_ps, dtype=torch.float32, device=dev)[:, None]
    drop = (rank >= k_t) | (before > p_t) | (sorted_p < sorted_p[:, :1] * minp_t)
    drop[:, 0] = False  # the most likely token always survives
    return probs, (sorted_p.masked_fill(drop, 0.0), order)
