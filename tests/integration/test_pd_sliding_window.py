"""PD through sglang-router for the sliding-window families, GPT-OSS (issue 12) and Gemma 3 (issue
46), on their tiny presets (window 32): their sliding layers keep only the window's pages on both
sides, so a request moves every page of the full layers but only the pages of the prompt's last
window for the sliding ones. 24 prompts of 1 to 150 tokens (most longer than the window, chunks of
64 that cut it), on (1,1) with and without layer pipelining, (1,2) and (2,1): tokens and logprobs
equal the colocated engine, and the bytes written equal that prediction (pd_parity.expected_bytes).
The trained Gemma-3-270M is test_pd_gemma3_270m.py's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvpipe.cache.window_pages import window_first_page
from kvpipe.model.checkpoint.config_reader import model_config_of
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
# (preset, prefill TP, decode TP, layer groups); `make test` runs GPT-OSS's same-TP pipelined and
# (2,1) pairings and all three of Gemma 3's
CASES = [
    pytest.param("tiny-gpt-oss", 1, 1, 1, marks=pytest.mark.slow),
    ("tiny-gpt-oss", 1, 1, 2),
    pytest.param("tiny-gpt-oss", 1, 2, 2, marks=pytest.mark.slow),
    ("tiny-gpt-oss", 2, 1, 1),
    ("tiny-gemma3", 1, 1, 2),
    ("tiny-gemma3", 1, 2, 2),
    ("tiny-gemma3", 2, 1, 1),
]


@pytest.fixture(scope="module")
def window_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, list]]:
    """preset -> its checkpoint and colocated reference, made on first use."""
    made: dict[str, tuple[Path, list]] = {}

    def get(name: str) -> tuple[Path, list]:
        if name not in made:
            model_dir = write_preset(name, tmp_path_factory.mktemp(name))
            assert model_config_of(model_dir).sliding_window == WINDOW
            made[name] = (model_dir, colocated_reference(model_dir, prompts(LENGTHS), NEW, PS))
        return made[name]

    return get


def test_prompts_reach_past_the_window() -> None:
    """Most prompts leave pages behind the window: the sliding layers send fewer pages."""
    behind = [n for n in LENGTHS if window_first_page(n, WINDOW, PS) > 0]
    assert len(LENGTHS) >= 20 and len(behind) >= 15


@pytest.mark.parametrize("preset,p_tp,d_tp,groups", CASES)
def test_pd_sliding_window_matches_colocated(
    window_model: Callable[[str], tuple[Path, list]], tmp_path: Path, preset: str, p_tp: int, d_tp: int, groups: int
) -> None:
    run_router_pd(window_model(preset), tmp_path, FLAGS, p_tp, d_tp, groups, LENGTHS, NEW, PS)
