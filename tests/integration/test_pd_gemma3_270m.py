"""PD through sglang-router on Gemma-3-270M's trained weights (its Q4_K_M GGUF, float32): the eight
plain-text prompts of tests/helpers/gemma3_270m.py and one of 2,100 tokens, chunked prefill of 768
(the sliding layers' window of 512 slides four times over the long one). Greedy tokens and
logprobs equal the colocated engine's, and the bytes the prefill writes equal the window
prediction exactly (pd_parity.expected_bytes: the 3 global layers every page of a prompt, the 15
sliding layers only the pages of its last window); the long prompt alone moves under half the
bytes of every page of every layer. (1,1) in `make test`; the replicated single KV head at (1,2)
and (2,1) in the full sweep."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.model.checkpoint.config_reader import model_config_of
from tests.helpers import gemma3_270m as g3
from tests.helpers.pd_parity import colocated_reference, expected_bytes, run_router_pd

pytest.importorskip("mooncake.engine")

PS, NEW, CHUNK = 16, 8, 768
FLAGS = [
    "--page-size",
    str(PS),
    "--max-total-tokens",
    "8192",
    "--chunked-prefill-size",
    str(CHUNK),
    "--disaggregation-heartbeat-interval",
    "0.5",
    "--disaggregation-bootstrap-timeout",
    "60",
    "--disaggregation-transfer-timeout",
    "30",
]
PAIRINGS = [(1, 1), pytest.param(1, 2, marks=pytest.mark.slow), pytest.param(2, 1, marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = g3.tokenizer()
    return [tok.encode(t) for t in g3.TEXTS] + [g3.long_prompt()]


@pytest.fixture(scope="module")
def gemma(prompts: list[list[int]]) -> tuple[Path, list]:
    path = g3.path()
    # the servers' --max-total-tokens: a sliding-window request holds its window pages beside its full ones
    return path, colocated_reference(path, prompts, NEW, PS, chunk=CHUNK, num_pages=8192 // PS)


def test_the_window_halves_the_long_prompts_bytes() -> None:
    """The prediction the PD runs are held to: global layers whole, sliding layers their window."""
    path, n = g3.path(), g3.LONG_TOKENS
    mc = model_config_of(path)
    assert (mc.num_layers, len(mc.sliding_layers), mc.sliding_window) == (18, 15, 512)
    every_page = -(-n // PS) * PS * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4
    window = expected_bytes(path, [n], PS, 1, 1)
    assert window < 0.5 * every_page, (window, every_page)


@pytest.mark.parametrize("p_tp,d_tp", PAIRINGS)
def test_pd_matches_colocated_and_sends_the_window(
    gemma: tuple[Path, list], prompts: list[list[int]], tmp_path: Path, p_tp: int, d_tp: int
) -> None:
    lengths = [len(p) for p in prompts]
    run_router_pd(gemma, tmp_path, FLAGS, p_tp, d_tp, 1, lengths, NEW, PS, ids=prompts)
