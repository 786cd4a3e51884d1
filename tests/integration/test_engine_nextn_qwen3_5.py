"""NEXTN on Qwen3.5 targets (their own mtp.* layer, model/draft/qwen3_5_mtp.py; engine/spec/mtp_drafter.py)
in the engine, on the tiny-qwen3.5 preset: greedy outputs with it are those without (batched,
chunked prefill, the hybrid radix cache with its state snapshots); every draft it proposes is
what the MTP layer computes from scratch for the request's tokens at that step (the target's
hidden states arrive, the recurrent state's rollback and cached prefixes keep the MTP input
right); a model whose MTP layer predicts exactly what the target will (a "bigram" copy) has every
draft accepted; the MoE variant's MTP layer (an MoE block) drafts too; nothing is left behind.
The MTP machinery shared with DeepSeek-V3 (copy on write at page boundaries, aborts, sampling)
is covered on tiny-deepseek-v3 (tests/integration/test_engine_nextn.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvpipe.config import ConfigError, ServerConfig, SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.engine.spec.mtp_drafter import check_nextn
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.draft.mtp import load_mtp
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.presets import write_preset
from tests.helpers.draft_models import bigram_copy
from tests.helpers.engine import assert_engine_matches, assert_every_draft_accepted, generations, make_engine, prompts
from tests.helpers.hybrid_model import pools
from tests.helpers.spec_drafts import DraftShape, assert_drafts_from_scratch, chain_from_scratch, record_drafts
from tests.helpers.tolerance import Route

GREEDY16 = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = prompts(5)  # 1 to 100 tokens
PAGE = 16
NEXTN = SpeculativeConfig("NEXTN", num_steps=3)


def assert_nothing_left(eng: Engine) -> None:
    st = eng.stats()
    assert st["free_pages"] == st["total_pages"], st
    assert eng.prefix_cache is None or eng.prefix_cache.locked_pages == 0
    assert eng.state_slots is not None and eng.state_slots.in_use() == {}
    assert eng.mtp is not None and not eng.mtp.seqs
    assert len(eng.mtp.free_private) == eng.mtp.num_private


def reference_generations(path: Path, ps: list[list[int]]):
    eng = make_engine(path, page_size=PAGE)
    try:
        return generations(eng, ps, GREEDY16)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(preset dir, its bigram copy, each one's greedy generations without speculation)."""
    path = write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("tiny_qwen35_nextn"))
    bigram = bigram_copy(path, tmp_path_factory.mktemp("bigram") / "m")
    return path, bigram, reference_generations(path, PROMPTS), reference_generations(bigram, PROMPTS)


class FromScratch:
    """The drafts of a request whose tokens are t_0 .. t_{n-1}, computed with nothing kept: the
    hybrid target over t_0 .. t_{n-2} in one forward from a zero state (its hidden states after
    the final norm), the MTP layer over (h_i, t_{i+1}) for every position in one extend, then the
    chain one token at a time. Each draft comes with its margin (top-1 minus top-2 logit) and the
    logits' tolerance."""

    def __init__(self, path: Path, pages: int = 32) -> None:
        self.model = load_model(path)
        cfg = self.model.cfg
        self.mtp = load_mtp(path, cfg)
        assert self.model.lm_head is not None
        self.mtp.set_target(self.model.embed_tokens, self.model.lm_head)
        self.pool, self.state = pools(self.model, pages, PAGE)
        self.mtp_pool = self.mtp.kv_pool(pages, PAGE, "cpu")
        self.table = torch.arange(pages, dtype=torch.int64)
        self.shape = DraftShape(cfg.num_layers + 1, cfg.hidden_size)

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[tuple[int, float, float]]:
        m = self.model
        fb = ForwardBatch.build([tokens[:-1]], [0], [self.table], PAGE, state_slots=[0])  # prefix 0: a zero state
        hidden = m.norm(m.forward_layers(m.embed(fb), fb, self.pool, 0, m.cfg.num_layers, self.state))
        return chain_from_scratch(self.mtp, self.mtp_pool, hidden, tokens, k, self.table, PAGE, self.shape)


def test_greedy_outputs_unchanged_and_drafts_from_the_mtp_layer(models):
    path, _, reference, _ = models
    eng = make_engine(path, page_size=PAGE, speculative=NEXTN, chunk=7, radix_cache=True)
    try:
        assert eng.mtp is not None and eng.mtp.pool.kv_heads == model_config_of(path).num_kv_heads
        seen = record_drafts(eng)
        assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY16, "NEXTN on Qwen3.5")
        c = eng.spec_counts
        assert c.proposed > 0 and c.emitted == c.verify_ct + c.accepted and c.accepted < c.proposed, c
        # again, the prompts behind their cached prefixes (hybrid: where a state snapshot is)
        assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY16, "NEXTN on Qwen3.5, cached")
        assert eng.scheduler.prefix_hit_tokens > 0
        assert sum(len(d) for _, d in seen) == eng.spec_counts.proposed
        ref = FromScratch(path)
        checked = seen[::2]
        compared = assert_drafts_from_scratch(checked, ref)
        assert compared > 0.9 * sum(len(d) for _, d in checked), compared
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_an_mtp_layer_that_predicts_the_target_has_every_draft_accepted(models):
    _, bigram, _, reference = models
    eng = make_engine(bigram, page_size=PAGE, speculative=NEXTN, chunk=7, radix_cache=True)
    try:
        # after the prefill's token each verify step emits 3 drafts and a bonus three times (12
        # outputs), then 2 + 1: 4 steps (the recurrent state rolled forward by every accepted draft)
        assert_every_draft_accepted(eng, PROMPTS, reference, GREEDY16, 4, "NEXTN on Qwen3.5, bigram")
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_the_moe_variants_mtp_layer_drafts(tmp_path_factory):
    """tiny-qwen3.5-moe: its MTP layer's MLP is the MoE block; outputs unchanged, drafts accepted
    sometimes (the MTP of random weights guesses the target now and then)."""
    path = write_preset("tiny-qwen3.5-moe", tmp_path_factory.mktemp("tiny_qwen35_moe_nextn"))
    ps = PROMPTS[2:]
    reference = reference_generations(path, ps)
    eng = make_engine(path, page_size=PAGE, speculative=NEXTN, chunk=24)
    try:
        assert_engine_matches(eng, ps, reference, Route.SAME_PROCESS, GREEDY16, "NEXTN on Qwen3.5-MoE")
        assert eng.spec_counts.proposed > 0
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_what_nextn_serves_on_qwen3_5(models, tmp_path):
    """Colocated and PD at TP 1 pass the checks (PD: tests/integration/test_pd_nextn_qwen3_5.py);
    a Qwen3.5 checkpoint without mtp_num_hidden_layers has no MTP layer to draft with."""
    path, _, _, _ = models
    cfg = ServerConfig(model_path=str(path), speculative=NEXTN)
    for mode in ("null", "prefill", "decode"):
        check_nextn(replace(cfg, disaggregation=replace(cfg.disaggregation, mode=mode)), model_config_of(path))
    raw = (path / "config.json").read_text()
    without = tmp_path / "no_mtp"
    without.mkdir()
    (without / "config.json").write_text(raw.replace('"mtp_num_hidden_layers": 1', '"mtp_num_hidden_layers": 0'))
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers"):
        check_nextn(replace(cfg, model_path=str(without)), model_config_of(without))


@pytest.mark.slow  # two TP 2 engines (~60 s on 2 cores); TP 1's sibling: the bigram test above
def test_tp2_mtp_layer_that_predicts_the_target_accepts_every_draft(models):
    """NEXTN at TP 2 on Qwen3.5 (the MTP layer whole on rank 0, fed rank 0's hidden states; the
    target's linear heads and recurrent state split over the ranks, rolled back on each): the
    bigram copy has every draft accepted and its outputs are TP 2's without speculation."""
    _, bigram, _, _ = models
    plain = make_engine(bigram, page_size=PAGE, tp=2)
    try:
        reference = generations(plain, PROMPTS, GREEDY16)
    finally:
        plain.shutdown()
    eng = make_engine(bigram, page_size=PAGE, tp=2, speculative=NEXTN, chunk=7, radix_cache=True)
    try:
        assert_every_draft_accepted(eng, PROMPTS, reference, GREEDY16, 4, "NEXTN on Qwen3.5 at TP 2, bigram")
        assert_nothing_left(eng)
    finally:
        eng.shutdown()
