"""The STANDALONE drafter (a draft model with the target's tokenizer, engine/spec/draft_model.py) in the
engine: greedy outputs with it are those without, batched with chunked prefill and the radix
cache; a draft model equal to the target has every draft accepted; a different draft (the tiny
preset written with another seed, or a noisy copy of the target that agrees in part) still gives
the target's outputs; no draft page is left after
the requests finish or are aborted mid-generation; sampled requests verify the draft's greedy
(point-mass) drafts by speculative sampling; draft models the drafter cannot serve are refused."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from kvpipe.config import ConfigError, SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.model.presets import write_preset
from tests.helpers.draft_models import noisy_copy
from tests.helpers.engine import (
    assert_engine_matches,
    assert_every_draft_accepted,
    check_sampled_speculation,
    make_engine,
    one_at_a_time,
    prompts,
    step_until_finished,
)
from tests.helpers.tolerance import Route

GREEDY24 = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = prompts()


def standalone(draft: Path, steps: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig("STANDALONE", num_steps=steps, draft_model_path=str(draft))


def assert_nothing_left(eng: Engine) -> None:
    st = eng.stats()
    assert st["free_pages"] == st["total_pages"], st
    assert eng.prefix_cache is None or eng.prefix_cache.locked_pages == 0
    assert eng.draft is not None and not eng.draft.book.seqs
    a = eng.draft.book.allocator
    assert a.num_free == a.num_pages


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target dir, another-seed draft dir, each prompt's greedy generation alone without speculation)."""
    path = write_preset("tiny", tmp_path_factory.mktemp("tiny"))
    other = write_preset("tiny", tmp_path_factory.mktemp("tiny_seed1"), seed=1)
    eng = make_engine(path)
    try:
        return path, other, one_at_a_time(eng, PROMPTS, GREEDY24)
    finally:
        eng.shutdown()


def test_draft_equal_to_target_accepts_every_draft(models):
    path, _, reference = models
    eng = make_engine(path, speculative=standalone(path), chunk=7, radix_cache=True)
    try:
        # after the prefill's token each verify step emits its drafts and a bonus: 3 + 1 tokens five
        # times (20 outputs), then 2 + 1 (max_new_tokens 24 leaves room for 2 drafts): 6 steps;
        # again behind the cached prefixes (the draft still catches up on all of it)
        assert_every_draft_accepted(eng, PROMPTS, reference, GREEDY24, 6, "STANDALONE, draft = target")
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("draft", ["seed1", "noisy"])
def test_other_draft_model_keeps_the_target_outputs(models, draft, tmp_path):
    """A draft of another seed (it never agrees: every chain rejected at its first draft) and a
    noisy copy of the target (chains accepted in part: the draft KV of the accepted drafts is
    kept, the rest recomputed) leave the target's outputs as they are."""
    path, other, reference = models
    drafter = other if draft == "seed1" else noisy_copy(path, tmp_path / "noisy")
    eng = make_engine(path, speculative=standalone(drafter, steps=4), chunk=7, radix_cache=True)
    try:
        assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY24, f"STANDALONE, {draft} draft")
        c = eng.spec_counts
        assert c.proposed > 0 and c.accepted <= c.proposed, c
        if draft == "noisy":
            assert 0 < c.accepted < c.proposed, c
        assert c.emitted == c.verify_ct + c.accepted
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_abort_mid_generation_frees_every_draft_page(models):
    path, other, _ = models
    eng = make_engine(path, speculative=standalone(other), radix_cache=True, chunk=16)
    try:
        # the middle one runs to its end; the others could not finish before they are aborted
        lens = (200, 40, 200)
        reqs = [
            Req(f"r{i}", list(p), replace(GREEDY24, max_new_tokens=n))
            for i, (p, n) in enumerate(zip(PROMPTS[2:5], lens))
        ]
        for r in reqs:
            eng.add_request(r)
        for _ in range(500):
            if all(r.spec is not None and r.spec.verify_ct >= 3 for r in reqs):
                break
            eng.step()
        assert eng.draft is not None and eng.draft.book.num_used_pages > 0
        eng.abort(reqs[0].rid)
        eng.abort(reqs[2].rid)
        eng.step()
        assert set(eng.draft.book.seqs) == {reqs[1].rid}  # the aborted requests' draft pages are back
        step_until_finished(eng, reqs)
        assert [r.finish_reason for r in reqs] == [FinishReason.ABORT, FinishReason.LENGTH, FinishReason.ABORT]
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_sampled_requests_verify_the_greedy_drafts(models):
    """temperature > 0: the draft model's argmax is a point-mass proposal, verified by speculative
    sampling as NGRAM's drafts. A seeded request is reproducible; a near-zero temperature with the
    target as its own draft accepts drafts; top_k=1 is greedy, as without speculation."""
    path, _, _ = models
    check_sampled_speculation(path, standalone(path), PROMPTS[3], assert_nothing_left)


def test_unservable_draft_models_are_refused(models, tmp_path):
    path, other, _ = models
    wide = tmp_path / "wide"
    shutil.copytree(other, wide)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["vocab_size"] += 64
    (wide / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="vocabulary"):
        make_engine(path, speculative=standalone(wide))
    with pytest.raises(ConfigError, match="sliding-window draft"):  # hybrid drafts: test_spec_hybrid.py
        make_engine(path, speculative=standalone(write_preset("tiny-gpt-oss", tmp_path / "g")))
    with pytest.raises(ConfigError, match="hybrid target or draft"):  # hybrid speculation: TP 1
        make_engine(path, speculative=standalone(write_preset("tiny-qwen3.5", tmp_path / "q")), tp=2)
    with pytest.raises(ConfigError, match="draft-model-path"):
        SpeculativeConfig("STANDALONE")
    with pytest.raises(ConfigError, match="draft-model-path"):
        SpeculativeConfig("NGRAM", draft_model_path=str(path))


def test_bench_engine_runs_the_standalone_drafter():
    """`kvpipe bench engine --speculative-algorithm STANDALONE --speculative-draft-model-path` on the
    tiny preset with itself as the draft: outputs equal, every draft accepted (no timing asserted)."""
    import argparse

    from kvpipe.bench.engine.command import add_args
    from kvpipe.bench.engine.run import run_bench
    from kvpipe.model.presets import default_model_dir

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(
        "--preset tiny --skip-prefill --skip-decode --speculative-algorithm standalone --spec-output-len 12 "
        "--spec-workload repeat --spec-batch 2 --repeat 1 --threads 1 --no-progress".split()
        + ["--speculative-draft-model-path", str(default_model_dir("tiny"))]
    )
    r = run_bench(args)["speculative"]
    assert r["outputs_equal"] and r["algorithm"] == "STANDALONE" and r["num_draft_tokens"] == 4
    assert r["accept_rate"] == 1.0 and r["accept_length"] > 1.0
