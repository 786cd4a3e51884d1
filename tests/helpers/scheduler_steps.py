"""Drive a Scheduler without a model: requests of counted tokens, one engine step with a fake
model (token = seq_len), page bookkeeping checked after every step, and draining until idle.
`hold`: keep a finished request's pages until release() (Scheduler.finish's knob)."""

from __future__ import annotations

import random

import numpy as np

from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.engine.scheduler import Scheduler


def req(rid: str, n: int, max_new: int = 4) -> Req:
    return Req(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=max_new))


def step(s: Scheduler, hold: bool = False, check: bool = True) -> ScheduledBatch | None:
    """One engine step with a fake model: token = seq_len; finish at max_new_tokens. `check`:
    check_pages (which counts every used page as a request's: no prefix cache)."""
    b = s.schedule()
    if b is None:
        return None
    if check:
        check_pages(s, b)
    toks = [r.seq_len if b.completes_prefill(i) else None for i, r in enumerate(b.reqs)]
    s.commit(b, toks, [0.0 if t is not None else None for t in toks])
    for r, t in zip(b.reqs, toks):
        if t is not None and len(r.output_ids) >= r.params.max_new_tokens:
            s.finish(r, FinishReason.LENGTH, hold=hold)
    return b


def check_pages(s: Scheduler, b: ScheduledBatch) -> None:
    """Every row has pages for exactly the tokens it holds after this step; no page shared."""
    for r, pre, n in zip(b.reqs, b.prefix_lens, b.extend_lens):
        tokens = max(pre + n, len(r.input_ids)) if s.whole_prompt_pages else pre + n
        assert len(r.pages) == -(-tokens // s.page_size)
    owners = s.running + list(s.reserved.values()) + list(s.held.values())
    # sliding-window models: the window pages come from the same allocator
    live = [r.pages for r in owners] + [r.swa_pages[r.swa_pages >= 0] for r in owners]
    allp = np.concatenate(live) if live else np.zeros(0)
    assert np.unique(allp).size == allp.size
    assert allp.size == s.allocator.num_used
    s.allocator.check_owned(allp.astype(np.int64))


def drain(s: Scheduler, limit: int = 10_000, hold: bool = False) -> list[ScheduledBatch]:
    batches: list[ScheduledBatch] = []
    for _ in range(limit):
        b = step(s, hold)
        if b is None:
            return batches
        batches.append(b)
    raise AssertionError("scheduler did not drain")


def random_load(
    s: Scheduler, rnd: random.Random, n: int = 200, steps: int = 5000
) -> tuple[list[Req], list[ScheduledBatch]]:
    """`n` requests of 1-40 prompt and 1-20 new tokens arriving at random (each step: one arrives with
    probability 0.5, a random one is aborted with probability 0.15), stepped (with `step`'s checks)
    until all are sent and the scheduler is idle, at most `steps` steps. Returns the requests and
    the batches; each step also checks that every used page belongs to a running or reserved one."""
    reqs: list[Req] = []
    batches: list[ScheduledBatch] = []
    for _ in range(steps):
        if len(reqs) < n and rnd.random() < 0.5:
            r = req(f"r{len(reqs)}", rnd.randint(1, 40), max_new=rnd.randint(1, 20))
            s.add(r)
            reqs.append(r)
        if reqs and rnd.random() < 0.15:
            s.abort(rnd.choice(reqs).rid)
        b = step(s)
        if b is not None:
            batches.append(b)
        held = sum(len(r.pages) for r in s.running) + sum(len(r.pages) for r in s.reserved.values())
        assert s.allocator.num_used == held
        if len(reqs) == n and not s.has_work():
            break
    assert len(reqs) == n and not s.has_work()
    return reqs, batches
