"""Qwen3.5 under tensor parallelism (gloo, CPU): tp=2 and tp=4 give the logits and greedy tokens
of tp=1, and each rank's StatePool holds exactly its heads' slice of the recurrent state. The MoE
variant (experts and shared expert split by their intermediate dim, the shared-expert gate
replicated, one all-reduce per MoE block) at tp=2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpipe.config import ParallelConfig
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from tests.helpers.tolerance import assert_close_logits
from tests.helpers.tp_ranks import run_ranks

# transformers (the `test` extra) with Qwen3.5: without them this module is skipped, not failed,
# so the helpers that build HF models are imported after the check
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

from tests.helpers.hf_models import save  # noqa: E402
from tests.helpers.hybrid_model import F, L, greedy_generate, hf_qwen3_5, hf_qwen3_5_moe, incremental_logits, pools  # noqa: E402

PAGE = 4
IDS = list(range(3, 30))  # 27 tokens: 19 prompt (prefilled in chunks of 5) + 8 decode steps
TABLE = torch.tensor([4, 0, 5, 2, 1, 7, 3])
SLOT = 1


def _run(parallel: ParallelConfig, model_dir: str) -> dict[str, object]:
    model = load_model(Path(model_dir), parallel)
    kv, state = pools(model, 8, PAGE)
    logits = incremental_logits(
        model, IDS, prompt_len=19, page_size=PAGE, chunk=5, page_table=TABLE, kv=kv, state=state, slot=SLOT
    )
    return {
        "logits": logits,
        "recurrent": [r[SLOT] for r in state.recurrent],
        "greedy": greedy_generate(model, IDS[:9], 16, PAGE),
    }


# 4 linear key heads / 8 value heads / 4 query heads split over 4 ranks; 2 KV heads replicate at tp=4
MODELS = {
    "dense": lambda: hf_qwen3_5(
        seed=3,
        num_hidden_layers=4,
        layer_types=[L, F, L, F],
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        attention_bias=True,
    ),
    "moe": lambda: hf_qwen3_5_moe(seed=3, layer_types=[L, F, L, F], linear_num_key_heads=4, linear_num_value_heads=8),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,world", [("dense", 2), pytest.param("dense", 4, marks=pytest.mark.slow), ("moe", 2)])
def test_tp_matches_tp1(family, world, tmp_path):
    model_dir = str(save(MODELS[family](), tmp_path / "model"))
    ranks = run_ranks(_run, world, tmp_path, model_dir)
    want = _run(ParallelConfig(), model_dir)
    cfg = model_config_of(model_dir)
    heads = 8 // world
    for rank in range(world):
        got = ranks[rank]
        assert_close_logits(got["logits"], want["logits"], cfg, len(IDS), msg=f"rank {rank}")
        assert got["greedy"] == want["greedy"]
        for g, w in zip(got["recurrent"], want["recurrent"]):
            assert g.shape[0] == heads  # this rank's value heads only
            assert_close_logits(g, w[rank * heads : (rank + 1) * heads], cfg, len(IDS))
