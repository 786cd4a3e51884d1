"""Speculative decoding with tensor parallelism, colocated (engine/spec/draft_model.py, tp_group.py): a
STANDALONE draft model sharded over the target's TP group (its KV heads split like the target's)
keeps the greedy outputs of TP 2 without speculation; a draft equal to the target has every draft
accepted; a noisy copy of it (chains accepted in part: the draft KV of rejected drafts rewritten on
every rank) keeps the outputs too; no draft page is left. NEXTN at TP 2 runs its MTP layer whole on
rank 0: an MTP layer that predicts the target has every draft accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.model.presets import write_preset
from tests.helpers.draft_models import bigram_copy, noisy_copy
from tests.helpers.engine import assert_engine_matches, assert_every_draft_accepted, make_engine, one_at_a_time, prompts
from tests.helpers.tolerance import Generation, Route

GREEDY24 = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = prompts(4)


def standalone(draft: Path, steps: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig("STANDALONE", num_steps=steps, draft_model_path=str(draft))


def assert_draft_sharded_and_free(eng: Engine) -> None:
    """The draft's KV pool holds one of the tiny preset's 2 KV heads per rank; every page is back."""
    st = eng.stats()
    assert st["free_pages"] == st["total_pages"], st
    assert eng.draft is not None and eng.draft.runner.pool.kv_heads == 1
    assert not eng.draft.book.seqs and eng.draft.book.allocator.num_free == eng.draft.book.allocator.num_pages


@pytest.fixture(scope="module")
def tp2_reference(tiny_model_dir: Path) -> list[Generation]:
    """Each prompt's greedy generation alone on a TP 2 engine without speculation."""
    eng = make_engine(tiny_model_dir, tp=2)
    try:
        return one_at_a_time(eng, PROMPTS, GREEDY24)
    finally:
        eng.shutdown()


def test_tp2_draft_equal_to_target_accepts_every_draft(tiny_model_dir: Path, tp2_reference):
    eng = make_engine(tiny_model_dir, tp=2, speculative=standalone(tiny_model_dir), chunk=7, radix_cache=True)
    try:
        # 3 drafts + 1 bonus five times (20 outputs after the prefill's), then 2 + 1: 6 steps
        assert_every_draft_accepted(eng, PROMPTS, tp2_reference, GREEDY24, 6, "STANDALONE at TP 2, draft = target")
        assert_draft_sharded_and_free(eng)
    finally:
        eng.shutdown()


def test_tp2_noisy_draft_keeps_the_target_outputs(tiny_model_dir: Path, tp2_reference, tmp_path: Path):
    eng = make_engine(tiny_model_dir, tp=2, speculative=standalone(noisy_copy(tiny_model_dir, tmp_path / "noisy"), 4))
    try:
        assert_engine_matches(eng, PROMPTS, tp2_reference, Route.SAME_PROCESS, GREEDY24, "STANDALONE at TP 2, noisy")
        c = eng.spec_counts
        assert 0 < c.accepted < c.proposed, c
        assert_draft_sharded_and_free(eng)
    finally:
        eng.shutdown()


@pytest.mark.slow  # two TP engines on the MoE preset (~40 s); TP 1's sibling: test_engine_nextn.py
def test_tp2_nextn_mtp_layer_that_predicts_the_target_accepts_every_draft(tmp_path: Path):
    """NEXTN at TP 2 (the MTP layer whole on rank 0, fed rank 0's all-reduced hidden states): the
    tiny DeepSeek-V3's bigram copy (tests/integration/test_engine_nextn.py) has every draft
    accepted and its outputs are TP 2's without speculation."""
    path = bigram_copy(write_preset("tiny-deepseek-v3", tmp_path / "preset"), tmp_path / "bigram")
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    plain = make_engine(path, tp=2)
    try:
        reference = one_at_a_time(plain, PROMPTS, params)
    finally:
        plain.shutdown()
    eng = make_engine(path, tp=2, speculative=SpeculativeConfig("NEXTN", num_steps=3), chunk=7, radix_cache=True)
    try:
        # 3 drafts + 1 bonus three times (12 outputs after the prefill's), then 2 + 1: 4 steps
        assert_every_draft_accepted(eng, PROMPTS, reference, params, 4, "NEXTN at TP 2, bigram")
        assert eng.mtp is not None and not eng.mtp.seqs
        st = eng.stats()
        assert st["free_pages"] == st["total_pages"], st
    finally:
        eng.shutdown()
