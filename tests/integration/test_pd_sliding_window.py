"""PD through sglang-router for GPT-OSS (issue 12): its sliding layers (window 32) keep only the
window's pages on both sides, so a request moves every page of the full layers but only the
pages of the prompt's last window for the sliding ones. 24 prompts of 1 to 150 tokens (most
longer than the window, chunks of 64 that cut it), on (1,1) with and without layer pipelining,
(1,2) and (2,1): tokens and logprobs equal the colocated engine, and the bytes written equal
that prediction (pd_parity.expected_bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.cache.window_pages import window_first_page
from kvpipe.model.presets import write_preset
from tests.helpers.pd_parity import MANY_LENGTHS, colocated_reference, prompts, run_router_pd

pytest.importorskip("mooncake.engine")

PS, NEW, WINDOW = 16, 6, 32
LENGTHS = MANY_LENGTHS
FLAGS = [
    "--page-size",
    str(PS),
    "--max-total-tokens",
    "8192",
    "--chunked-prefill-size",
    "64",
    "--disaggregation-heartbeat-interval",
    "0.5",
    "--disaggregation-bootstrap-timeout",
    "30",
    "--disaggregation-transfer-timeout",
    "3",
]
# (prefill TP, decode TP, layer groups); `make test` runs one same-TP and one heterogeneous pairing
PAIRINGS = [
    pytest.param(1, 1, 1, marks=pytest.mark.slow),
    (1, 1, 2),
    pytest.param(1, 2, 2, marks=pytest.mark.slow),
    (2, 1, 1),
]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    model_dir = write_preset("tiny-gpt-oss", tmp_path_factory.mktemp("tiny-gpt-oss"))
    return model_dir, colocated_reference(model_dir, prompts(LENGTHS), NEW, PS)


def test_prompts_reach_past_the_window() -> None:
    """Most prompts leave pages behind the window: the sliding layers send fewer pages."""
    behind = [n for n in LENGTHS if window_first_page(n, WINDOW, PS) > 0]
    assert len(LENGTHS) >= 20 and len(behind) >= 15


@pytest.mark.parametrize("p_tp,d_tp,groups", PAIRINGS)
def test_pd_sliding_window_matches_colocated(
    gpt_oss: tuple[Path, list], tmp_path: Path, p_tp: int, d_tp: int, groups: int
) -> None:
    run_router_pd(gpt_oss, tmp_path, FLAGS, p_tp, d_tp, groups, LENGTHS, NEW, PS)
