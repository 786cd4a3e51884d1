"""Speculative decoding (NGRAM) on the sliding-window tiny-gpt-oss (window 32, page size 16 and 4):
a verify step's rejected drafts give back their window pages with their full-layer pages, and
window pages slide out only by the accepted position (Scheduler.commit_verify / rollback_pages).
Greedy tokens and logprobs equal those without speculation, batched, with chunked prefill and the
sliding-window prefix cache; drafts are accepted and rejected; every page is free afterwards; and
the same on a PD decode server (in process), whose window pages start with the prompt's last window."""

from __future__ import annotations

import random

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, SamplingParams
from kvpipe.model.presets import write_preset
from tests.helpers.engine import assert_engine_matches, make_engine, one_at_a_time, prompts
from tests.helpers.pd_pair import assert_pd_matches, colocated_greedy, make_pair
from tests.helpers.tolerance import Route

NGRAM = SpeculativeConfig("NGRAM", num_draft_tokens=5)
GREEDY24 = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def repetitive_prompts() -> list[list[int]]:
    rnd = random.Random(7)
    units = [[rnd.randrange(3, 250) for _ in range(n)] for n in (3, 5, 8)]
    return [u * (60 // len(u)) + u[:2] for u in units]  # past the window of 32


PROMPTS = prompts(5) + repetitive_prompts()


def assert_no_pages_lost(eng: Engine) -> None:
    st = eng.stats()
    assert st["free_pages"] == st["total_pages"], st  # free or evictable cache pages
    assert eng.prefix_cache is None or eng.prefix_cache.locked_pages == 0
    assert not eng.scheduler.running and not eng.scheduler.waiting


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_preset("tiny-gpt-oss", tmp_path_factory.mktemp("gpt_oss"))
    eng = make_engine(path)
    try:
        return path, one_at_a_time(eng, PROMPTS, GREEDY24)
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "kw", [dict(chunk=7, radix_cache=True), dict(page_size=4, pages=1024)], ids=["chunk7_radix", "page4"]
)
def test_greedy_outputs_equal_without_speculation(model, kw):
    path, reference = model
    eng = make_engine(path, speculative=NGRAM, **kw)
    try:
        assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY24, "sliding window, speculative")
        c = eng.spec_counts
        assert 0 < c.accepted < c.proposed, c
        if kw.get("radix_cache"):
            assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY24, "sliding window, cached")
        assert_no_pages_lost(eng)
    finally:
        eng.shutdown()


def test_pd_decode_matches_colocated(model):
    path, _ = model
    ref = colocated_greedy(path)
    reference = next(ref)
    try:
        ps = repetitive_prompts() + prompts(3)[1:]
        with make_pair(path, 24, decode_speculative=NGRAM) as pair:
            reqs = [pair.reqs(ids, GREEDY24) for ids in ps]
            pair.run(reqs)
            decoded = [d for _, d in reqs]
            assert all(d.finish_reason is FinishReason.LENGTH for d in decoded)
            assert_pd_matches(decoded, ps, reference, "PD NGRAM, sliding window")
            c = pair.decode.spec_counts
            assert 0 < c.accepted < c.proposed, c
            pair.settle()
    finally:
        ref.close()
