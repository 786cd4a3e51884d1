"""Speculative decoding (NGRAM) in the engine: greedy outputs with speculation are those without,
token for token and logprob for logprob, on GQA (tiny) and MLA (tiny-deepseek-v3), batched, with
chunked prefill, the radix cache and TP; repetitive text gets drafts accepted; stop tokens and
max_new_tokens inside an accepted run end the request where plain decoding does; no page is lost
after the requests finish or are aborted mid-generation (hybrid models: test_spec_hybrid.py,
sliding-window ones: test_spec_sliding_window.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.model.presets import write_preset
from tests.helpers.engine import (
    assert_engine_matches,
    check_sampled_speculation,
    make_engine,
    one_at_a_time,
    output_ids,
    prompts,
    step_until_finished,
)
from tests.helpers.tolerance import Route

NGRAM = SpeculativeConfig("NGRAM", num_draft_tokens=5)
GREEDY24 = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def repetitive_prompts(vocab: int = 250) -> list[list[int]]:
    """Prompts that repeat a short unit (3, 5 or 8 tokens): their own n-grams predict them."""
    rnd = random.Random(3)
    out = []
    for n in (3, 5, 8):
        unit = [rnd.randrange(3, vocab) for _ in range(n)]
        out.append(unit * (40 // n) + unit[:2])
    return out


PROMPTS = prompts() + repetitive_prompts()


def assert_no_pages_lost(eng: Engine) -> None:
    st = eng.stats()
    assert st["free_pages"] == st["total_pages"], st  # free or evictable cache pages
    assert eng.prefix_cache is None or eng.prefix_cache.locked_pages == 0
    assert not eng.scheduler.running and not eng.scheduler.waiting


@pytest.fixture(scope="module", params=["tiny", "tiny-deepseek-v3"])
def model(request, tmp_path_factory):
    """(model dir, each prompt's greedy generation alone without speculation)."""
    path = write_preset(request.param, tmp_path_factory.mktemp(request.param.replace(".", "_")))
    eng = make_engine(path)
    try:
        return path, one_at_a_time(eng, PROMPTS, GREEDY24)
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "kw",
    [
        dict(chunk=7, radix_cache=True),
        pytest.param(dict(chunk=33, page_size=1, pages=4096), marks=pytest.mark.slow),  # a page per token
        dict(chunk=33, tp=2),
    ],
    ids=["chunk7_radix", "page1", "tp2"],
)
def test_greedy_outputs_equal_without_speculation(model, kw):
    path, reference = model
    eng = make_engine(path, speculative=NGRAM, **kw)
    try:
        route = Route.ACROSS_PROCESSES if kw.get("tp", 1) > 1 else Route.SAME_PROCESS
        assert_engine_matches(eng, PROMPTS, reference, route, GREEDY24, "speculative, batched")
        c = eng.spec_counts
        assert c.proposed > 0 and c.accepted > 0, c  # a drafter that never proposes fails here
        assert c.emitted == c.verify_ct + c.accepted  # no stop inside a run: every accepted draft emitted
        if kw.get("radix_cache"):  # again, every prompt now behind its cached prefix
            assert_engine_matches(eng, PROMPTS, reference, route, GREEDY24, "speculative, cached prefixes")
        assert_no_pages_lost(eng)
    finally:
        eng.shutdown()


def test_repetitive_prompt_accepts_drafts_and_reports_them(model):
    path, reference = model
    eng = make_engine(path, speculative=NGRAM, radix_cache=True)
    try:
        i = len(PROMPTS) - 1
        res = eng.generate([PROMPTS[i]], GREEDY24)[0]
        assert tuple(res["output_ids"]) == reference[i].tokens
        meta = res["meta_info"]
        assert meta["spec_accept_token_num"] > 0 and meta["spec_draft_token_num"] >= meta["spec_accept_token_num"]
        # the first token comes from the prefill; each verify step emits 1 + its accepted drafts
        assert meta["spec_verify_ct"] + meta["spec_accept_token_num"] == meta["completion_tokens"] - 1
        assert meta["spec_verify_ct"] < meta["completion_tokens"] - 1
        st = eng.stats()
        assert st["spec_accepted_tokens"] == meta["spec_accept_token_num"]
    finally:
        eng.shutdown()


def test_max_new_tokens_and_stop_tokens_inside_accepted_runs(model):
    path, _ = model
    ps = repetitive_prompts()
    plain = make_engine(path)
    spec = make_engine(path, speculative=SpeculativeConfig("NGRAM", num_draft_tokens=8), radix_cache=True)
    try:
        for m in (1, 2, 3, 6, 11):
            params = replace(GREEDY24, max_new_tokens=m)
            got = output_ids(spec, ps, params)
            assert got == output_ids(plain, ps, params) and all(len(g) == m for g in got)
        full = output_ids(plain, ps, GREEDY24)
        for p, out in zip(ps, full):
            # the latest first occurrence of a token: plain decoding stops there
            j = max(k for k, t in enumerate(out) if t not in out[:k])
            params = replace(GREEDY24, stop_token_ids=(out[j],))
            accepted_before = spec.spec_counts.accepted
            res = spec.generate([p], params)[0]
            want = plain.generate([p], params)[0]
            assert res["output_ids"] == want["output_ids"] == out[: j + 1]
            assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": out[j]}
            assert spec.spec_counts.accepted >= accepted_before
        assert spec.spec_counts.accepted > 0
        assert_no_pages_lost(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_abort_mid_generation_frees_every_page(model):
    path, _ = model
    eng = make_engine(path, speculative=NGRAM, radix_cache=True, chunk=16)
    try:
        params = replace(GREEDY24, max_new_tokens=40)
        reqs = [Req(f"r{i}", list(p), params) for i, p in enumerate(repetitive_prompts())]
        for r in reqs:
            eng.add_request(r)
        for _ in range(500):
            if all(r.spec is not None and r.spec.verify_ct >= 3 for r in reqs):
                break
            eng.step()
        assert reqs[0].spec is not None and reqs[0].spec.proposed > 0
        eng.abort(reqs[0].rid)
        eng.abort(reqs[2].rid)
        step_until_finished(eng, reqs)
        assert [r.finish_reason for r in reqs] == [FinishReason.ABORT, FinishReason.LENGTH, FinishReason.ABORT]
        assert_no_pages_lost(eng)
    finally:
        eng.shutdown()


def test_sampled_requests_verify_drafts_by_speculative_sampling(model):
    """temperature > 0: drafts are verified by speculative sampling (tests/unit/test_spec_sampling.py
    checks that it keeps the target's distribution). Here: a seeded request is reproducible and runs
    to max_new_tokens; a near-zero temperature accepts drafts; top_k=1 is greedy, as without
    speculation; no page is lost."""
    check_sampled_speculation(model[0], NGRAM, repetitive_prompts()[0], assert_no_pages_lost)


def test_bench_engine_reports_speculative_decoding():
    """`kvpipe bench engine --speculative-algorithm NGRAM` on the tiny preset: both engines' outputs
    are equal and the acceptance figures are there (no timing asserted)."""
    import argparse

    from kvpipe.bench.engine.command import add_args
    from kvpipe.bench.engine.run import run_bench

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(
        "--preset tiny --skip-prefill --skip-decode --speculative-algorithm ngram --spec-output-len 24 "
        "--spec-workload repeat --spec-batch 2 --repeat 1 --threads 1 --no-progress".split()
    )
    r = run_bench(args)["speculative"]
    assert r["outputs_equal"] and r["workload"] == "repeat" and r["batch"] == 2
    assert all(1 <= n <= 24 for n in r["completion_tokens"]) and r["num_draft_tokens"] == 8
    assert r["accept_length"] >= 1.0 and len(r["samples_on"]) == len(r["samples_off"]) == 1
