"""PD of the hybrid tiny-qwen3.5 preset (and, in one case, tiny-qwen3.5-moe) with a prefill
Engine and a decode Engine in one process (local backend, real bootstrap and ZMQ): greedy tokens
and logprobs equal the colocated engine's with and without chunked prefill and layer groups (a
corrupted state slot or full-attention page on the decode fails that check), the bytes
written are the full layers' KV pages plus one state slot per request, and every page and state
slot is free afterwards on both sides, also after injected transfer failures and aborts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.engine.engine import Engine
from kvpipe.engine.request import Req
from kvpipe.model.presets import write_preset
from tests.helpers.corrupt_kv import KVCorruption, corrupt_state_slot
from tests.helpers.pd_pair import (
    Pair,
    assert_landed_equals_cold,
    colocated_greedy,
    failures_then_decode_abort,
    greedy_and_bytes_as_predicted,
    prompts,
)

LENS = [1, 15, 16, 17, 40, 100]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("tiny_qwen35_pd"))


@pytest.fixture(scope="module")
def reference(model_dir):
    yield from colocated_greedy(model_dir)


def assert_slots_free(*engines: Engine) -> None:
    for eng in engines:
        assert eng.state_slots is not None and eng.state_slots.in_use() == {}


@pytest.mark.parametrize("chunk,groups", [(0, 1), (24, 1), (0, 2), (24, 2)])
def test_greedy_matches_colocated_and_bytes_as_predicted(model_dir, reference, chunk, groups):
    check_greedy_and_bytes(model_dir, reference, chunk, groups)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> Path:
    return write_preset("tiny-qwen3.5-moe", tmp_path_factory.mktemp("tiny_qwen35_moe_pd"))


def test_moe_greedy_matches_colocated_and_bytes_as_predicted(moe_model_dir):
    """Qwen3.5-MoE: the same KV pages and state slots (its MLP holds no per-request state); one
    chunked, layer-grouped case keeps it cheap."""
    ref = colocated_greedy(moe_model_dir)
    try:
        check_greedy_and_bytes(moe_model_dir, next(ref), chunk=24, groups=2)
    finally:
        ref.close()


def test_fp8_kv_matches_colocated_fp8(model_dir):
    """--kv-cache-dtype fp8_e4m3: the full-attention layers' pages in fp8, the state slots in
    their own dtypes (fp32 here), two layer groups; bytes: 1-byte KV plus the fp32 state."""
    ref = colocated_greedy(model_dir, "fp8_e4m3")
    try:
        check_greedy_and_bytes(model_dir, next(ref), 0, 2, kv_cache_dtype="fp8_e4m3")
    finally:
        ref.close()


def check_greedy_and_bytes(
    model_dir: Path, reference, chunk: int, groups: int, on_landed=None, kv_cache_dtype: str = "auto"
) -> None:
    greedy_and_bytes_as_predicted(
        model_dir,
        reference,
        chunk,
        groups,
        LENS,
        check_free=lambda pair: assert_slots_free(pair.prefill, pair.decode),
        on_landed=on_landed,
        kv_cache_dtype=kv_cache_dtype,
    )


@pytest.mark.parametrize("what", ["state_slot", "full_layer_page"])
def test_a_corrupted_state_slot_or_page_fails_the_check(model_dir, reference, what):
    """Negative control: the (24, 2) case with the 40-token prompt's recurrent state (its slot in
    the first delta-net layer) or one page of the full-attention layer overwritten on the decode
    after it landed: the exactness check fails on that prompt alone."""
    target = 4  # LENS[4] == 40 tokens
    ps = prompts(24 + 2, LENS)  # greedy_and_bytes_as_predicted's prompts for chunk 24, 2 groups

    def corrupt(pair: Pair, d: Req) -> None:
        if d.input_ids != ps[target]:
            return
        if what == "state_slot":
            assert pair.decode.runner.state_pool is not None and d.state_slot is not None
            corrupt_state_slot(pair.decode.runner.state_pool, d.state_slot)
        else:
            KVCorruption(layer=0, page=1).apply(pair.decode.runner.pool, d.pages)  # the pool's one (full) layer

    pattern = rf"same process and TP: prompt {target} \({LENS[target]} tokens\): [^\n]*position [1-9][^\n]*\Z"
    with pytest.raises(AssertionError, match=pattern):
        check_greedy_and_bytes(model_dir, reference, 24, 2, on_landed=corrupt)


def test_landed_state_and_pages_equal_a_cold_colocated_run(model_dir):
    """The decode's state slot (every linear layer's conv and delta-rule state) and the full
    layer's pages, as they land, equal a cold colocated engine's after the whole prefill."""
    assert_landed_equals_cold(model_dir, prompts(3, [17, 40, 100]), chunk=24)


def test_failures_and_aborts_free_state_slots(model_dir, reference):
    failures_then_decode_abort(model_dir, reference, lambda pair: assert_slots_free(pair.prefill, pair.decode))
