"""Speculative decoding (NGRAM, STANDALONE) on the hybrid tiny Qwen3.5 (gated delta-net recurrent
state), in a colocated engine: a verify forward keeps the state after each input and the engine
commits the accepted one (engine/spec/state_rollback.py). Greedy tokens and logprobs equal those without
speculation, batched, with chunked prefill and the hybrid prefix cache (its hits included). NGRAM:
the tiny preset rarely repeats itself, so its drafts are mostly rejected (every step rolls back);
each request's per-step drafts and accepted counts agree with its output; aborts leave no page,
state slot or snapshot behind; a negative control: without the rollback the outputs go wrong.
STANDALONE with a hybrid draft model (its own recurrent state, engine/spec/draft_state.py): a draft equal
to the target accepts every draft, a noisy copy of it some, the outputs unchanged; sampled requests
go through speculative sampling."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.model.presets import write_preset
from tests.helpers.draft_models import noisy_copy
from tests.helpers.engine import (
    assert_engine_matches,
    assert_every_draft_accepted,
    check_sampled_speculation,
    generations,
    make_engine,
    one_at_a_time,
    prompts,
    step_until_finished,
)
from tests.helpers.tolerance import Generation, Route, generation_atol, generation_difference

NGRAM = SpeculativeConfig("NGRAM", num_draft_tokens=5)
GREEDY24 = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat a short unit (3, 5 or 8 tokens): their own n-grams predict them."""
    rnd = random.Random(5)
    units = [[rnd.randrange(3, 250) for _ in range(n)] for n in (3, 5, 8)]
    return [u * (40 // len(u)) + u[:2] for u in units]


PROMPTS = prompts(4) + repetitive_prompts()[1:]


def assert_nothing_left(eng: Engine) -> None:
    """No page, state slot or pinned snapshot outlives the requests."""
    st = eng.stats()
    assert st["free_pages"] == st["total_pages"], st  # free or evictable cache pages
    assert eng.prefix_cache is None or eng.prefix_cache.locked_pages == 0
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.state_slots is not None and eng.state_slots.in_use() == {}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(model dir, each prompt's greedy generation alone without speculation)."""
    path = write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("qwen3_5"))
    eng = make_engine(path)
    try:
        return path, one_at_a_time(eng, PROMPTS, GREEDY24)
    finally:
        eng.shutdown()


def assert_steps_match_outputs(eng: Engine, label: str) -> None:
    """Each request's recorded verify steps (drafts, accepted) agree with its output: the accepted
    drafts are the tokens emitted next, the draft after them is not, the bonus token follows."""
    reqs = [Req(f"{label}-{i}", list(p), GREEDY24) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        eng.add_request(r)
    step_until_finished(eng, reqs)
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH and r.spec is not None
        out, pos = r.output_ids, 1  # the first token is the prefill's
        for drafts, accepted in r.spec.steps:
            assert list(drafts[:accepted]) == out[pos : pos + accepted], (r.rid, r.spec.steps, out)
            assert accepted == len(drafts) or out[pos + accepted] != drafts[accepted]
            pos += accepted + 1
        assert pos == len(out), (r.rid, r.spec.steps, out)


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param(dict(chunk=7, radix_cache=True), marks=pytest.mark.slow),  # ~180 s on a loaded 2-core box
        dict(chunk=0),
        # the state commits reach every rank (ForwardSpec.state_commits)
        pytest.param(dict(chunk=33, tp=2), marks=pytest.mark.slow),
    ],
    ids=["chunk7_radix", "whole", "tp2"],
)
def test_greedy_outputs_equal_without_speculation(model, kw):
    path, reference = model
    eng = make_engine(path, speculative=NGRAM, **kw)
    try:
        route = Route.ACROSS_PROCESSES if kw.get("tp", 1) > 1 else Route.SAME_PROCESS
        assert_engine_matches(eng, PROMPTS, reference, route, GREEDY24, "hybrid speculative, batched")
        c = eng.spec_counts
        # drafts rejected and rolled back (a rollback that never happens tests nothing)
        assert c.accepted < c.proposed, c
        assert c.emitted == c.verify_ct + c.accepted
        assert_steps_match_outputs(eng, "steps")
        if kw.get("radix_cache"):  # every prompt behind its cached prefix (state snapshots restored)
            cached = [r["meta_info"]["cached_tokens"] for r in eng.generate(PROMPTS, GREEDY24)]
            assert sum(cached) > 0, cached
            assert_engine_matches(eng, PROMPTS, reference, route, GREEDY24, "hybrid speculative, cached")
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_abort_mid_generation_frees_every_page_and_slot(model):
    eng = make_engine(model[0], speculative=NGRAM, radix_cache=True, chunk=16)
    try:
        params = replace(GREEDY24, max_new_tokens=40)
        reqs = [Req(f"r{i}", list(p), params) for i, p in enumerate(repetitive_prompts())]
        for r in reqs:
            eng.add_request(r)
        for _ in range(500):
            if all(r.spec is not None and r.spec.verify_ct >= 3 for r in reqs):
                break
            eng.step()
        eng.abort(reqs[0].rid)
        eng.abort(reqs[2].rid)
        step_until_finished(eng, reqs)
        assert [r.finish_reason for r in reqs] == [FinishReason.ABORT, FinishReason.LENGTH, FinishReason.ABORT]
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_sampled_requests_verify_drafts_by_speculative_sampling(model):
    """temperature > 0 on a hybrid model: speculative sampling (tests/unit/test_spec_sampling.py
    checks its distribution) with the state rolled back to the accepted position; the target as
    its own draft, so a near-zero temperature accepts drafts."""
    check_sampled_speculation(model[0], standalone(model[0]), PROMPTS[2], assert_draft_free)


def test_without_rollback_outputs_go_wrong(model, monkeypatch):
    """Negative control: a verify that leaves the state after the last draft in the slot (no
    rollback copies) changes the outputs of prompts whose drafts get rejected."""
    path, reference = model
    eng = make_engine(path, speculative=NGRAM)
    try:
        assert eng._rollback is not None
        monkeypatch.setattr(eng._rollback, "take", lambda: [])
        got = generations(eng, PROMPTS, GREEDY24)
        atol = generation_atol(Route.SAME_PROCESS, reference)
        wrong = [generation_difference(g, w, atol) is not None for g, w in zip(got, reference)]
        assert sum(wrong) >= 2, wrong
    finally:
        eng.shutdown()


def standalone(draft) -> SpeculativeConfig:
    return SpeculativeConfig("STANDALONE", num_steps=3, draft_model_path=str(draft))


def assert_draft_free(eng: Engine) -> None:
    assert_nothing_left(eng)
    draft = eng.draft
    assert draft is not None and not draft.book.seqs and draft.states is not None
    assert not draft.states.seqs and draft.states.slots.in_use() == {}
    assert draft.book.allocator.num_free == draft.book.allocator.num_pages


@pytest.mark.slow
def test_standalone_draft_equal_to_target_accepts_every_draft(model):
    """The hybrid target as its own draft: after the prefill's token each verify step emits 3
    drafts and a bonus five times, then 2 + 1 (max_new_tokens 24): 6 steps, every draft accepted
    (the draft's state caught up from its base, not from its chain's); again behind cached prefixes."""
    path, reference = model
    eng = make_engine(path, speculative=standalone(path), chunk=7, radix_cache=True)
    try:
        assert_every_draft_accepted(eng, PROMPTS, reference, GREEDY24, 6, "STANDALONE hybrid, draft = target")
        assert_draft_free(eng)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_standalone_noisy_draft_keeps_the_target_outputs(model, tmp_path):
    """A noisy copy of the target as draft: chains accepted in part (its state and KV rolled back
    to the accepted prefix), the target's outputs unchanged."""
    path, reference = model
    eng = make_engine(path, speculative=standalone(noisy_copy(path, tmp_path / "noisy")))
    try:
        assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY24, "STANDALONE hybrid, noisy")
        c = eng.spec_counts
        assert 0 < c.accepted < c.proposed, c
        assert_draft_free(eng)
    finally:
        eng.shutdown()


def test_standalone_draft_equal_to_target_small(model):
    """The fast sibling of the two above: two prompts, 8 tokens (3 drafts and a bonus, then 2 and
    a bonus: 2 verify steps), chunked, with the hybrid prefix cache."""
    path, reference = model
    params = replace(GREEDY24, max_new_tokens=8)
    eng = make_engine(path, speculative=standalone(path), chunk=7, radix_cache=True)
    try:
        ps = PROMPTS[2:4]
        want = [Generation(g.tokens[:8], g.logprobs[:8]) for g in reference[2:4]]  # greedy: a prefix of 24
        assert_every_draft_accepted(eng, ps, want, params, 2, "STANDALONE hybrid, small")
        assert_draft_free(eng)
    finally:
        eng.shutdown()
