"""The NEXTN drafter (DeepSeek-V3's multi-token-prediction layer, engine/spec/mtp_drafter.py) in the
engine, on the tiny-deepseek-v3 preset: greedy outputs with it are those without (batched,
chunked prefill, the radix cache); every draft it proposes is what the MTP layer computes from
scratch for the request's tokens at that step (the target's hidden states arrive, rollback and
cached prefixes keep the MTP KV right); a model whose MTP layer predicts exactly what the target
will (a "bigram" copy) has every draft accepted; aborts leave no MTP state and no page; sampled
requests verify its greedy drafts by speculative sampling; what NEXTN cannot serve is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError, ServerConfig, SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.model_runner import make_kv_pool
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.engine.spec.mtp_drafter import check_nextn
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.draft.mtp import load_mtp
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.presets import write_preset
from tests.helpers.draft_models import bigram_copy
from tests.helpers.engine import (
    assert_engine_matches,
    assert_every_draft_accepted,
    check_sampled_speculation,
    generations,
    make_engine,
    prompts,
    step_until_finished,
)
from tests.helpers.spec_drafts import DraftShape, assert_drafts_from_scratch, chain_from_scratch, record_drafts
from tests.helpers.tolerance import Route

GREEDY16 = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = prompts(5)  # 1 to 100 tokens
PAGE = 16


def nextn(steps: int = 3, algorithm: str = "NEXTN") -> SpeculativeConfig:
    return SpeculativeConfig(algorithm, num_steps=steps)


def assert_nothing_left(eng: Engine) -> None:
    st = eng.stats()
    assert st["free_pages"] == st["total_pages"], st
    assert eng.prefix_cache is None or eng.prefix_cache.locked_pages == 0
    assert eng.mtp is not None and not eng.mtp.seqs
    assert len(eng.mtp.free_private) == eng.mtp.num_private  # every hit's private page is back


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(preset dir, its bigram copy, each one's greedy generations without speculation)."""
    path = write_preset("tiny-deepseek-v3", tmp_path_factory.mktemp("tiny_deepseek_v3"))
    bigram = bigram_copy(path, tmp_path_factory.mktemp("bigram") / "m")
    refs = []
    for p in (path, bigram):
        eng = make_engine(p, page_size=PAGE)
        try:
            refs.append(generations(eng, PROMPTS, GREEDY16))
        finally:
            eng.shutdown()
    return path, bigram, refs[0], refs[1]


class FromScratch:
    """The drafts of a request whose tokens are t_0 .. t_{n-1}, computed with nothing kept: the
    target over t_0 .. t_{n-2} in one forward (its hidden states after the final norm), the MTP
    layer over (h_i, t_{i+1}) for every position in one extend, then the chain one token at a
    time. Each draft comes with its margin (top-1 minus top-2 logit) and the logits' tolerance."""

    def __init__(self, path: Path, pages: int = 32) -> None:
        self.model = load_model(path)
        cfg = self.model.cfg
        self.mtp = load_mtp(path, cfg)
        self.pool = make_kv_pool(self.model, pages, PAGE)
        assert cfg.mla is not None
        self.mtp_pool = KVPool(1, pages, PAGE, 1, cfg.mla.latent_dim, latent=True)
        self.table = torch.arange(pages, dtype=torch.int64)
        self.shape = DraftShape(cfg.num_layers + 1, cfg.hidden_size)

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[tuple[int, float, float]]:
        m = self.model
        fb = ForwardBatch.build([tokens[:-1]], [0], [self.table], PAGE)
        hidden = m.norm(m.forward_layers(m.embed(fb), fb, self.pool, 0, m.cfg.num_layers))
        return chain_from_scratch(self.mtp, self.mtp_pool, hidden, tokens, k, self.table, PAGE, self.shape)


def test_greedy_outputs_unchanged_and_drafts_from_the_mtp_layer(models):
    path, _, reference, _ = models
    eng = make_engine(path, page_size=PAGE, speculative=nextn(), chunk=7, radix_cache=True)
    try:
        seen = record_drafts(eng)
        assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY16, "NEXTN")
        c = eng.spec_counts
        assert c.proposed > 0 and c.emitted == c.verify_ct + c.accepted, c
        cold = len(seen)
        # again, every prompt behind its cached prefix: the MTP KV came with the cached pages
        assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY16, "NEXTN, cached")
        assert eng.scheduler.prefix_hit_tokens > 0
        assert seen[cold:] and eng.mtp is not None and eng.mtp.hit_copies == 0  # same next tokens
        # prompts that leave the cached ones exactly at a page boundary: the MTP row of the
        # prefix's last position depends on the next token, recomputed in a private page copy
        diverging = [p[: 2 * PAGE] + [(t + 1) % 250 + 3 for t in p[2 * PAGE : 2 * PAGE + 12]] for p in PROMPTS[3:]]
        plain = make_engine(path, page_size=PAGE)
        try:
            want = generations(plain, diverging, GREEDY16)
        finally:
            plain.shutdown()
        div_start = len(seen)
        assert_engine_matches(eng, diverging, want, Route.SAME_PROCESS, GREEDY16, "NEXTN, diverging at a page")
        assert eng.mtp.hit_copies == len(diverging)
        assert sum(len(d) for _, d in seen) == eng.spec_counts.proposed
        # from scratch: every other proposal before (each is a whole target forward), every one after
        checked = seen[:div_start:2] + seen[div_start:]
        compared = assert_drafts_from_scratch(checked, FromScratch(path))
        assert compared > 0.9 * sum(len(d) for _, d in checked), compared
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_an_mtp_layer_that_predicts_the_target_has_every_draft_accepted(models):
    _, bigram, _, reference = models
    eng = make_engine(bigram, page_size=PAGE, speculative=nextn(), chunk=7, radix_cache=True)
    try:
        # after the prefill's token each verify step emits 3 drafts and a bonus three times (12
        # outputs), then 2 + 1 (max_new_tokens 16 leaves room for 2 drafts): 4 steps
        assert_every_draft_accepted(eng, PROMPTS, reference, GREEDY16, 4, "NEXTN, bigram")
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_abort_mid_generation_drops_the_mtp_state(models):
    """EAGLE (without a draft model: SGLang's name for MTP drafting) runs the same drafter."""
    path, _, _, _ = models
    eng = make_engine(path, page_size=PAGE, speculative=nextn(algorithm="EAGLE"), radix_cache=True, chunk=16)
    try:
        assert eng.mtp is not None
        lens = (200, 30, 200)  # the middle one runs to its end; the others are aborted before theirs
        reqs = [
            Req(f"r{i}", list(p), replace(GREEDY16, max_new_tokens=n))
            for i, (p, n) in enumerate(zip(PROMPTS[2:5], lens))
        ]
        for r in reqs:
            eng.add_request(r)
        for _ in range(500):
            if all(r.spec is not None and r.spec.verify_ct >= 3 for r in reqs):
                break
            eng.step()
        assert set(eng.mtp.seqs) == {r.rid for r in reqs}
        eng.abort(reqs[0].rid)
        eng.abort(reqs[2].rid)
        eng.step()
        assert set(eng.mtp.seqs) == {reqs[1].rid}
        step_until_finished(eng, reqs)
        assert [r.finish_reason for r in reqs] == [FinishReason.ABORT, FinishReason.LENGTH, FinishReason.ABORT]
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_sampled_requests_verify_the_greedy_drafts(models):
    _, bigram, _, _ = models
    check_sampled_speculation(bigram, nextn(), PROMPTS[3], assert_nothing_left)


def test_what_nextn_cannot_serve_is_refused(models, tiny_model_dir):
    path, _, _, _ = models
    with pytest.raises(ConfigError, match="multi-token-prediction"):
        make_engine(tiny_model_dir, speculative=nextn())  # a Llama: no MTP layer
    eng_cfg = ServerConfig(model_path=str(path), speculative=nextn())
    # colocated and PD (tests/integration/test_pd_nextn.py, test_pd_nextn_tp.py), any TP: served
    for mode in ("null", "prefill", "decode"):
        for tp in (1, 2):
            served = replace(eng_cfg, tp_size=tp, disaggregation=replace(eng_cfg.disaggregation, mode=mode))
            check_nextn(served, model_config_of(path))


def test_page_ids_are_shared_with_the_target_pool(models):
    """The MTP pool has the target pool's page ids, then the chain's scratch pages, then the
    private copies of cached pages (two per running request)."""
    path, _, _, _ = models
    eng = make_engine(path, page_size=PAGE, pages=64, speculative=nextn(steps=5))
    try:
        mtp = eng.mtp
        assert mtp is not None
        scratch = len(mtp.scratch)
        assert np.array_equal(mtp.scratch, np.arange(64, 64 + scratch))
        assert scratch * PAGE >= 5  # the chain's positions past a request's pages
        assert mtp.num_private == 2 * eng.cfg.scheduler.max_running_requests
        assert sorted(mtp.free_private) == list(range(64 + scratch, 64 + scratch + mtp.num_private))
        assert mtp.pool.num_pages == eng.runner.pool.num_pages + scratch + mtp.num_private
    finally:
        eng.shutdown()
