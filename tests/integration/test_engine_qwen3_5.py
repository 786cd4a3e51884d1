"""The engine serving the hybrid tiny-qwen3.5 preset (colocated): concurrent requests of varied
lengths, chunked prefill, a small state-slot budget, aborts, TP 2/4 all give HF generate's
greedy tokens, and every state slot and page is free afterwards."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req
from kvpipe.model.presets import write_preset
from tests.helpers.engine import GREEDY, output_ids, prompts
from tests.helpers.recording_connector import RecordingConnector

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

PROMPTS = prompts(8)  # 1 to 150 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("tiny_qwen35"))


@pytest.fixture(scope="module")
def reference(model_dir):
    """HF generate, each prompt alone, greedy, EOS ignored (no eos id)."""
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = hf.generate(
            torch.tensor([p]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        assert len(ids) == GREEDY.max_new_tokens
        out.append(ids)
    assert len({tuple(o) for o in out}) == len(out)  # not a degenerate model
    return out


def make_engine(
    model_dir,
    chunk: int = 0,
    tp: int = 1,
    slots: int | None = None,
    radix_cache: bool = False,
    max_running: int = 64,
    **kw,
) -> Engine:
    cfg = ServerConfig(
        model_path=str(model_dir),
        tp_size=tp,
        cache=CacheConfig(page_size=16, num_pages=256, radix_cache=radix_cache, max_state_slots=slots),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_running_requests=max_running),
    )
    return Engine(cfg, **kw)


def all_free(eng: Engine) -> bool:
    return (
        eng.state_slots.in_use() == {}
        and eng.state_slots.num_free == eng.state_slots.num_slots
        and eng.allocator.num_free == eng.allocator.num_pages
    )


@pytest.mark.parametrize("chunk", [0, 7, 33])
def test_concurrent_requests_equal_hf_one_at_a_time(model_dir, reference, chunk):
    eng = make_engine(model_dir, chunk=chunk)
    try:
        assert eng.prefix_cache is None and eng.runner.state_pool is not None
        assert eng.runner.pool.num_layers == 1  # one full-attention layer keeps KV pages
        assert output_ids(eng, PROMPTS) == reference
        assert all_free(eng)
    finally:
        eng.shutdown()


def test_few_state_slots_make_requests_wait(model_dir, reference):
    eng = make_engine(model_dir, chunk=33, slots=2)
    try:
        assert eng.runner.state_pool.num_slots == 2 and eng.stats()["total_state_slots"] == 2
        assert output_ids(eng, PROMPTS) == reference
        assert all_free(eng)
    finally:
        eng.shutdown()


def test_aborts_free_slots_and_leave_others_intact(model_dir, reference):
    eng = make_engine(model_dir, chunk=16, slots=4)
    deadline = time.monotonic() + 300

    def step_until(cond) -> None:
        while not cond():
            assert time.monotonic() < deadline
            eng.step()

    try:
        reqs = [Req(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        for r in reqs:
            eng.add_request(r)
        eng.step()
        r2, r5, r7 = reqs[2], reqs[5], reqs[7]
        assert r2.state_slot is not None and 0 < r2.num_cached < len(r2.input_ids)  # mid-prefill
        assert r7.state_slot is None  # queued behind the slot budget
        eng.abort("r2")
        eng.abort("r7")
        step_until(lambda: r5.num_cached > 0)  # the 150-token prompt, prefilling in chunks of 16
        assert not r5.prefill_done
        eng.abort("r5")
        decoding = next(r for r in reqs if r.output_ids and not r.finished)
        eng.abort(decoding.rid)
        aborted = {r2.rid, r5.rid, r7.rid, decoding.rid}
        step_until(lambda: all(r.finished for r in reqs))
        for i, r in enumerate(reqs):
            if r.rid in aborted:
                assert r.finish_reason is FinishReason.ABORT, i
            else:
                assert r.output_ids == reference[i], i
        assert all_free(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_matches_hf(model_dir, reference, tp):
    eng = make_engine(model_dir, chunk=33, tp=tp)
    try:
        assert eng.runner.state_pool.shape.heads == 8 // tp  # this rank's linear value heads
        assert output_ids(eng, PROMPTS) == reference
        assert all_free(eng)
    finally:
        eng.shutdown()


def test_radix_cache_keeps_state_snapshots_colocated_and_is_off_with_a_connector(model_dir, caplog):
    """Colocated: a HybridRadixCache whose snapshots take 2 state slots per running request after
    theirs (tests/integration/test_engine_qwen3_5_prefix_cache.py tests it); behind a KV connector
    (PD) it is still off, with a log line."""
    eng = make_engine(model_dir, radix_cache=True, max_running=4)
    try:
        assert isinstance(eng.prefix_cache, HybridRadixCache) and eng.scheduler.cache is eng.prefix_cache
        assert eng.runner.state_pool.num_slots == 4 + 8 and eng.prefix_cache.snapshots.first == 4
    finally:
        eng.shutdown()
    conn = RecordingConnector()
    conn.prefix_cache = True  # as a PD prefill's connector says
    with caplog.at_level(logging.INFO, logger="kvpipe.engine.prefix_cache_setup"):
        eng = make_engine(model_dir, radix_cache=True, connector=conn)
    try:
        assert eng.prefix_cache is None and eng.scheduler.cache is None
        assert any("prefix caching (radix cache) is disabled" in m for m in caplog.messages)
    finally:
        eng.shutdown()


def test_a_connector_gets_the_state_pool(model_dir):
    """PD of a hybrid model: the connector's worker moves the state pool with the KV pool."""
    conn = RecordingConnector()
    eng = make_engine(model_dir, connector=conn)
    try:
        assert conn.state_pool is eng.runner.state_pool and conn.state_pool is not None
    finally:
        eng.shutdown()
