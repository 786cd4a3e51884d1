"""The EAGLE drafter (an EAGLE head for a Llama target, engine/spec/eagle_drafter.py, run by the NEXTN
drafter's machinery) in the engine, on the tiny preset: greedy outputs with it are those without
(batched, chunked prefill, the radix cache, a prompt leaving a cached one at a page boundary);
every draft it proposes is what the head computes from scratch for the request's tokens at that
step; a head that predicts a bigram target exactly has every draft accepted; sampled requests
verify its greedy drafts by speculative sampling; what it cannot serve is refused."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from kvpipe.config import ConfigError, ServerConfig, SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.model_runner import make_kv_pool
from kvpipe.engine.request import SamplingParams
from kvpipe.engine.spec.eagle_drafter import EagleDrafter, check_eagle
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.draft.eagle import load_eagle
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.presets import write_preset
from tests.helpers.draft_models import bigram_copy, write_eagle_head
from tests.helpers.engine import (
    assert_engine_matches,
    assert_every_draft_accepted,
    check_sampled_speculation,
    generations,
    make_engine,
    one_at_a_time,
    prompts,
)
from tests.helpers.spec_drafts import DraftShape, assert_drafts_from_scratch, chain_from_scratch, record_drafts
from tests.helpers.tolerance import Route

GREEDY16 = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = prompts(5)  # 1 to 100 tokens
PAGE = 16


def eagle(head: Path, steps: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig("EAGLE", num_steps=steps, draft_model_path=str(head))


def assert_nothing_left(eng: Engine) -> None:
    st = eng.stats()
    assert st["free_pages"] == st["total_pages"], st
    assert eng.prefix_cache is None or eng.prefix_cache.locked_pages == 0
    assert isinstance(eng.mtp, EagleDrafter) and not eng.mtp.seqs
    assert len(eng.mtp.free_private) == eng.mtp.num_private


@dataclass(frozen=True)
class Models:
    tiny: Path
    head: Path  # a random head for tiny (its drafts mostly rejected)
    bigram: Path  # tiny with every layer adding nothing: the next token follows the last one only
    exact: Path  # the head that predicts bigram exactly
    noisy: Path  # the exact head plus noise: bigram's drafts accepted in part
    tiny_ref: list
    bigram_ref: list


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Models:
    tmp = tmp_path_factory.mktemp("eagle")
    bigram = bigram_copy(tiny_model_dir, tmp / "bigram")
    refs = []
    for p in (tiny_model_dir, bigram):
        eng = make_engine(p, page_size=PAGE)
        try:
            refs.append(generations(eng, PROMPTS, GREEDY16))
        finally:
            eng.shutdown()
    return Models(
        tiny_model_dir,
        write_eagle_head(tiny_model_dir, tmp / "head", seed=1),
        bigram,
        write_eagle_head(bigram, tmp / "exact", bigram=1.0, noise=0.0),
        write_eagle_head(bigram, tmp / "noisy", bigram=1.0, noise=0.5, seed=2),
        refs[0],
        refs[1],
    )


class FromScratch:
    """The drafts of a request whose tokens are t_0 .. t_{n-1}, computed with nothing kept: the
    target over t_0 .. t_{n-2} (its hidden states after the final norm), the head over (h_i,
    t_{i+1}) for every position in one extend, then the chain one token at a time feeding the
    head's own output forward. Each draft comes with its margin and the logits' tolerance."""

    def __init__(self, target: Path, head: Path, pages: int = 32) -> None:
        self.model = load_model(target)
        self.head = load_eagle(head, self.model.cfg)
        assert self.model.lm_head is not None
        self.head.set_target(self.model.embed_tokens, self.model.lm_head)
        self.pool = make_kv_pool(self.model, pages, PAGE)
        self.head_pool = self.head.kv_pool(pages, PAGE, "cpu")
        self.table = torch.arange(pages, dtype=torch.int64)
        self.shape = DraftShape(self.model.cfg.num_layers + 1, self.model.cfg.hidden_size)

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[tuple[int, float, float]]:
        m = self.model
        fb = ForwardBatch.build([tokens[:-1]], [0], [self.table], PAGE)
        hidden = m.norm(m.forward_layers(m.embed(fb), fb, self.pool, 0, m.cfg.num_layers))
        return chain_from_scratch(self.head, self.head_pool, hidden, tokens, k, self.table, PAGE, self.shape)


@pytest.mark.parametrize("which", ["random", pytest.param("noisy", marks=pytest.mark.slow)])
def test_greedy_outputs_unchanged_and_drafts_from_the_head(models: Models, which: str):
    """The random head on tiny (drafts mostly rejected), and (the full sweep) the noisy head on
    the bigram target (chains accepted in part: the head KV of rejected drafts recomputed)."""
    target, head, reference = (
        (models.tiny, models.head, models.tiny_ref)
        if which == "random"
        else (models.bigram, models.noisy, models.bigram_ref)
    )
    eng = make_engine(target, page_size=PAGE, speculative=eagle(head), chunk=7, radix_cache=True)
    try:
        assert isinstance(eng.mtp, EagleDrafter) and not eng.mtp.pool.latent
        seen = record_drafts(eng)
        assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY16, f"EAGLE, {which} head")
        c = eng.spec_counts
        assert c.proposed > 0 and c.emitted == c.verify_ct + c.accepted, c
        # again, behind the cached prefixes: the head KV came with the cached pages
        assert_engine_matches(eng, PROMPTS, reference, Route.SAME_PROCESS, GREEDY16, "EAGLE, cached")
        assert eng.scheduler.prefix_hit_tokens > 0 and eng.mtp.hit_copies == 0
        # prompts that leave the cached ones at a page boundary: that page's last head row
        # (K and V) is recomputed in a private copy for the other next token
        diverging = [p[: 2 * PAGE] + [(t + 1) % 250 + 3 for t in p[2 * PAGE : 2 * PAGE + 12]] for p in PROMPTS[3:]]
        plain = make_engine(target, page_size=PAGE)
        try:
            want = generations(plain, diverging, GREEDY16)
        finally:
            plain.shutdown()
        div_start = len(seen)
        assert_engine_matches(eng, diverging, want, Route.SAME_PROCESS, GREEDY16, "EAGLE, diverging at a page")
        assert eng.mtp.hit_copies == len(diverging)
        checked = seen[:div_start:2] + seen[div_start:]
        compared = assert_drafts_from_scratch(checked, FromScratch(target, head))
        assert compared > 0.9 * sum(len(d) for _, d in checked), compared
        if which == "noisy":
            assert 0 < c.accepted < c.proposed, c
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_a_head_that_predicts_the_target_has_every_draft_accepted(models: Models):
    eng = make_engine(models.bigram, page_size=PAGE, speculative=eagle(models.exact), chunk=7, radix_cache=True)
    try:
        # after the prefill's token: 3 drafts + a bonus three times (12 outputs), then 2 + 1: 4 steps
        assert_every_draft_accepted(eng, PROMPTS, models.bigram_ref, GREEDY16, 4, "EAGLE, exact head")
        assert_nothing_left(eng)
    finally:
        eng.shutdown()


def test_sampled_requests_verify_the_greedy_drafts(models: Models):
    check_sampled_speculation(models.bigram, eagle(models.exact), PROMPTS[3], assert_nothing_left)


def test_what_eagle_cannot_serve_is_refused(models: Models, tmp_path: Path):
    # NEXTN drafts with the checkpoint's own layer; EAGLE without a path stays NEXTN
    with pytest.raises(ConfigError, match="goes with STANDALONE, an EAGLE head with EAGLE"):
        SpeculativeConfig("NEXTN", draft_model_path=str(models.head))
    assert SpeculativeConfig("EAGLE").eagle_head_path is None and SpeculativeConfig("EAGLE").uses_mtp
    spec = eagle(models.head)
    assert spec.uses_mtp and spec.eagle_head_path == str(models.head) and spec.standalone_draft_path is None
    with pytest.raises(ConfigError, match="Llama-family targets"):  # a DeepSeek-V3 target
        make_engine(write_preset("tiny-deepseek-v3", tmp_path / "ds"), speculative=spec)
    cfg = ServerConfig(model_path=str(models.tiny), speculative=spec)
    target = model_config_of(models.tiny)
    for mode in ("null", "prefill", "decode"):  # served at any TP: the head whole on rank 0 (PD: test_pd_eagle_tp.py)
        for tp in (1, 2):
            check_eagle(replace(cfg, tp_size=tp, disaggregation=replace(cfg.disaggregation, mode=mode)), target)


@pytest.mark.slow  # two TP 2 engines (~40 s on 2 cores); TP 1's sibling: test_a_head_that_predicts_...
def test_tp2_head_runs_whole_on_rank_0_and_accepts_every_draft(models: Models):
    """EAGLE at TP 2, colocated: the head runs whole on rank 0 (fed rank 0's all-reduced hidden
    states, the replicated embedding and lm_head; no TP child loads it as a draft model); the
    exact head on the bigram target has every draft accepted, outputs as TP 2 without it."""
    plain = make_engine(models.bigram, page_size=PAGE, tp=2)
    try:
        reference = one_at_a_time(plain, PROMPTS, GREEDY16)
    finally:
        plain.shutdown()
    eng = make_engine(models.bigram, page_size=PAGE, tp=2, speculative=eagle(models.exact), chunk=7, radix_cache=True)
    try:
        assert eng.draft is None and isinstance(eng.mtp, EagleDrafter)
        assert_every_draft_accepted(eng, PROMPTS, reference, GREEDY16, 4, "EAGLE at TP 2, exact head")
        assert_nothing_left(eng)
    finally:
        eng.shutdown()
