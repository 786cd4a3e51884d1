"""PD through sglang-router for the MoE and MLA families (issue 13): Qwen3-MoE and MiniMax-M2
(GQA KV, sparse MLP) and DeepSeek-V3 (MLA latent KV, group-limited MoE), on TP pairings
(1,2), (2,1), (2,4) with layer pipelining on and off (Qwen3-MoE and MiniMax-M2, whose KV layouts
are the same, share them), token-exact against the colocated engine.
The bytes every prefill rank writes equal the prediction for the layout: K/V head slices for the
GQA families, and for MLA one whole latent per decode rank, read from exactly one prefill rank.
The hybrid Qwen3.5 (issue 12: KV of its full-attention layers plus each request's recurrent
state, sliced by linear heads under heterogeneous TP) runs 24 prompts on (1,1) and (2,2) with one
and two layer groups, and on (1,2) and (2,1). GPT-OSS (sliding-window pages) has its own file,
test_pd_sliding_window.py. --kv-cache-dtype: an fp8 MLA latent, bf16 GQA K/V, and Qwen3.5's and
GPT-OSS's KV in fp8 and bf16, on (1,2) and (2,1)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvpipe.model.presets import write_preset
from tests.helpers.pd_parity import MANY_LENGTHS, colocated_reference, prompts, run_router_pd

pytest.importorskip("mooncake.engine")

PS, NEW = 16, 6
LENGTHS = [150, 37, 90]
FLAGS = [
    "--page-size",
    str(PS),
    "--max-total-tokens",
    "4096",
    "--chunked-prefill-size",
    "64",
    "--disaggregation-heartbeat-interval",
    "0.5",
    "--disaggregation-bootstrap-timeout",
    "30",
    "--disaggregation-transfer-timeout",
    "3",
]
FAMILIES = ["tiny-qwen3-moe", "tiny-minimax-m2", "tiny-deepseek-v3"]
PAIRINGS = [(1, 2, 2), (2, 1, 1), (2, 4, 2)]  # (prefill TP, decode TP, layer groups; 1: no pipelining)
# Qwen3.5: same TP with and without pipelining, and both heterogeneous directions (state sliced by heads)
HYBRID_PAIRINGS = [(1, 1, 1), (2, 2, 2), (1, 2, 2), (2, 1, 1)]
# 24 prompts, 1 to 150 tokens: chunks of 64 carry the state across 1 to 3 forwards
HYBRID_LENGTHS = MANY_LENGTHS


# MiniMax-M2 moves the same GQA K/V layout as Qwen3-MoE (what differs, its routing and whole-q/k
# norm, is TP-tested in test_model_moe.py): the two share the pairings, to keep make test short
GQA_MOE = {"tiny-qwen3-moe": [(1, 2, 2), (2, 4, 2)], "tiny-minimax-m2": [(2, 1, 1)]}
CASES = [(f, pairing) for f in FAMILIES for pairing in GQA_MOE.get(f, PAIRINGS)]
# `make test` runs each family's heterogeneous directions once; decode TP 4 (2 -> 4) and the
# same-TP hybrid pairings are the full sweep (`make test-full`)
SLOW_CASES = {("tiny-qwen3-moe", (2, 4, 2)), ("tiny-deepseek-v3", (2, 4, 2))}
SLOW_HYBRID = {(1, 1, 1), (2, 2, 2), (2, 1, 1)}


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, list]]:
    """name -> the family's checkpoint and colocated reference, made on first use."""
    made: dict[str, tuple[Path, list]] = {}

    def get(name: str) -> tuple[Path, list]:
        if name not in made:
            model_dir = write_preset(name, tmp_path_factory.mktemp(name))
            made[name] = (model_dir, colocated_reference(model_dir, prompts(LENGTHS), NEW, PS))
        return made[name]

    return get


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    model_dir = write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("tiny-qwen3.5"))
    return model_dir, colocated_reference(model_dir, prompts(HYBRID_LENGTHS), NEW, PS)


@pytest.mark.parametrize(
    "name,pairing",
    [pytest.param(*c, marks=[pytest.mark.slow] if c in SLOW_CASES else []) for c in CASES],
    ids=[f"{f}-{p}-{d}-{g}" for f, (p, d, g) in CASES],
)
def test_pd_family_matches_colocated(
    family: Callable[[str], tuple[Path, list]], tmp_path: Path, name: str, pairing: tuple[int, int, int]
) -> None:
    run_pd(family(name), tmp_path, *pairing)


# --kv-cache-dtype on both servers (issue 26): MLA's latent in fp8 e4m3 and GQA K/V in bf16, on
# both heterogeneous directions, against colocated with the same KV dtype. Whole prompts: a later
# chunk reads the rounded KV of the earlier ones, and chunk boundaries depend on which prompts
# share a prefill step (the chunk budget is per step), which concurrent requests do not fix
# Qwen3.5 stores its full-attention layers' K/V in the KV dtype (its recurrent state keeps its
# own), GPT-OSS its window pages and full pages alike (prompts of 150 tokens pass its window of 32)
KV_DTYPE_CASES = [
    ("tiny-deepseek-v3", (1, 2, 2), "fp8_e4m3"),
    ("tiny-qwen3-moe", (2, 1, 1), "bfloat16"),
    ("tiny-qwen3.5", (2, 1, 1), "fp8_e4m3"),
    ("tiny-gpt-oss", (1, 2, 2), "bfloat16"),
    ("tiny-qwen3.5", (1, 2, 2), "bfloat16"),
    ("tiny-gpt-oss", (2, 1, 1), "fp8_e4m3"),
]
SLOW_KV_DTYPE = {("tiny-qwen3.5", (1, 2, 2), "bfloat16"), ("tiny-gpt-oss", (2, 1, 1), "fp8_e4m3")}
WHOLE_PROMPTS = [*FLAGS, "--chunked-prefill-size", "0"]  # the last value of a flag wins


@pytest.mark.parametrize(
    "name,pairing,kv",
    [pytest.param(*c, marks=[pytest.mark.slow] if c in SLOW_KV_DTYPE else []) for c in KV_DTYPE_CASES],
    ids=[f"{f}-{p}-{d}-{g}-{kv}" for f, (p, d, g), kv in KV_DTYPE_CASES],
)
def test_pd_kv_cache_dtype_matches_colocated(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, name: str, pairing: tuple[int, int, int], kv: str
) -> None:
    model_dir = write_preset(name, tmp_path_factory.mktemp(name))
    reference = colocated_reference(model_dir, prompts(LENGTHS), NEW, PS, kv, chunk=0)
    run_router_pd((model_dir, reference), tmp_path, WHOLE_PROMPTS, *pairing, LENGTHS, NEW, PS, kv)


@pytest.mark.parametrize(
    "p_tp,d_tp,groups",
    [pytest.param(*p, marks=[pytest.mark.slow] if p in SLOW_HYBRID else []) for p in HYBRID_PAIRINGS],
)
def test_pd_hybrid_matches_colocated(
    hybrid: tuple[Path, list], tmp_path: Path, p_tp: int, d_tp: int, groups: int
) -> None:
    run_pd(hybrid, tmp_path, p_tp, d_tp, groups, HYBRID_LENGTHS)


def run_pd(
    model: tuple[Path, list], tmp_path: Path, p_tp: int, d_tp: int, groups: int, lengths: list[int] = LENGTHS
) -> None:
    run_router_pd(model, tmp_path, FLAGS, p_tp, d_tp, groups, lengths, NEW, PS)
