"""A speculative decode step's commit: each row's drafts verified against the target's logits
(greedy rows by matching, sampled rows by speculative sampling), the accepted tokens appended,
the rest rolled back (its pages, a hybrid model's recurrent state) and the counts kept.

Rows go one at a time (a generator): the engine finishes a row that stopped before the next row
is committed, as a colocated step would.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.finish import FinishChecker
from kvpipe.engine.request import FinishReason, Req
from kvpipe.engine.sampler import RequestGenerators, Sampler
from kvpipe.engine.scheduler import Scheduler
from kvpipe.engine.spec.sampling import speculative_sample
from kvpipe.engine.spec.state_rollback import StateRollback
from kvpipe.engine.spec.verify import SpecCounts, accepted_prefix

Finish = tuple[FinishReason, str | int | None]  # FinishChecker.check's verdict


class VerifyStep:
    def __init__(
        self,
        sampler: Sampler,
        generators: RequestGenerators,
        scheduler: Scheduler,
        finisher: FinishChecker,
        rollback: StateRollback | None,
    ) -> None:
        """`rollback`: a hybrid model's recurrent-state rollback (None: no recurrent state)."""
        self.sampler = sampler
        self.generators = generators
        self.scheduler = scheduler
        self.finisher = finisher
        self.rollback = rollback
        self.counts = SpecCounts()  # the server's verify steps, drafts proposed and accepted

    def commit(self, batch: ScheduledBatch, logits: torch.Tensor) -> Iterator[tuple[Req, int, Finish | None]]:
        """logits [sum(1 + drafts), V]: each row's target tokens after its last token and each
        draft; a greedy row keeps the longest matching prefix of its drafts and the bonus token,
        a sampled row what speculative sampling accepts and one drawn token. Yields, per row still
        running, (request, tokens appended, its finish or None)."""
        counts = [1 + len(d) for d in batch.drafts]
        assert logits.shape[0] == sum(counts), (tuple(logits.shape), counts)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        by_row = self._plain_rows(batch, logits, counts, starts)
        for i, req in enumerate(batch.reqs):
            draft = batch.drafts[i]
            if req.finished:  # aborted while its forward ran
                continue
            if i in by_row:
                targets, lps = by_row[i]
                accepted = accepted_prefix(draft, targets)
            else:
                rows = logits[starts[i] : starts[i] + counts[i]]
                targets, accepted = self._speculative_sample(req, rows, draft)
                raw = torch.log_softmax(rows.float(), dim=-1)  # logprobs of the raw logits, as the sampler's
                lps = [float(raw[j, t]) for j, t in enumerate(targets)]
            fins: list[Finish] = []
            n = self.scheduler.commit_verify(
                req, batch.prefix_lens[i], targets[: accepted + 1], lps[: accepted + 1], partial(self._stops, fins)
            )
            if self.rollback is not None:  # before the finish: its snapshots go to the cache there
                cache = self.scheduler.cache if isinstance(self.scheduler.cache, HybridRadixCache) else None
                s = self.scheduler
                self.rollback.verified(req, batch.prefix_lens[i], counts[i], n, cache, s.allocator, s.page_size)
            self.counts.add(len(draft), accepted, n)
            if req.spec is None:
                req.spec = SpecCounts()
            req.spec.record(draft, accepted, n)
            yield req, n, (fins[0] if fins else None)

    def _plain_rows(
        self, batch: ScheduledBatch, logits: torch.Tensor, counts: list[int], starts: list[int]
    ) -> dict[int, tuple[list[int], list[float]]]:
        """Greedy rows (argmax at every position) and rows without drafts (one plain draw) go
        through the sampler as any decode step: their (tokens, logprobs) by row."""
        plain = [
            (i, j)
            for i, (r, c) in enumerate(zip(batch.reqs, counts))
            if r.params.greedy or c == 1
            for j in range(starts[i], starts[i] + c)
        ]
        sel = torch.tensor([j for _, j in plain], dtype=torch.int64, device=logits.device)
        sampled = self.sampler.sample(
            logits[sel],
            [batch.reqs[i].params for i, _ in plain],
            [self.generators.get(batch.reqs[i]) for i, _ in plain],
        )
        by_row: dict[int, tuple[list[int], list[float]]] = {}
        for (i, _), t, lp in zip(plain, sampled.token_ids, sampled.logprobs):
            toks, lps = by_row.setdefault(i, ([], []))
            toks.append(t)
            lps.append(lp)
        return by_row

    def _speculative_sample(self, req: Req, logits: torch.Tensor, draft: list[int]) -> tuple[list[int], int]:
        """A sampled row's drafts verified by speculative sampling -> (its accepted drafts and one
        drawn token, the drafts accepted)."""
        gen = self.generators.get(req)
        weights = self.sampler.distributions(logits, [req.params] * logits.shape[0])
        return speculative_sample(
            weights, draft, partial(self.sampler.uniform, gen), partial(self.sampler.draw, gen=gen)
        )

    def _stops(self, fins: list[Finish], req: Req) -> bool:
        """commit_verify's check after each appended token: a finish goes into `fins`."""
        fin = self.finisher.check(req, 1)
        if fin is not None:
            fins.append(fin)
        return fin is not None
