"""GPT-OSS against HF transformers, fp32: sliding-window and full layers, attention sinks, the
top-k-softmax MoE with biased fused experts and clamped SwiGLU, yarn RoPE (truncate=false); the
three attention paths (whole prompt, chunks behind a cached prefix, batched paged decode past the
window), the config checks and the tiny-gpt-oss preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from tests.helpers.paged_model import incremental_logits

# transformers comes with the `test` extra: without it this module is skipped, not failed, so the
# helpers that build HF models are imported after the check
transformers = pytest.importorskip("transformers")

from tests.helpers.hf_gpt_oss import CASES, hf_gpt_oss  # noqa: E402
from tests.helpers.hf_models import prompt_ids, save  # noqa: E402
from tests.helpers.window_parity import (  # noqa: E402
    batched_decode_rows_match_hf,
    chunks_and_decode_past_window_match_hf,
    full_prompt_matches_hf,
    greedy_matches_hf_generate,
    preset_is_reproducible_and_matches_hf,
)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    hf = hf_gpt_oss(**CASES[request.param])
    return hf, load_model(save(hf, tmp_path_factory.mktemp(request.param)))


def test_config_fields(case):
    hf, ours = case
    cfg = ours.cfg
    assert cfg.architecture == "gpt_oss" and cfg.attention_sinks
    assert cfg.sliding_layers == tuple(i for i, t in enumerate(hf.config.layer_types) if t == "sliding_attention")
    assert cfg.sliding_window == hf.config.sliding_window and cfg.o_proj_bias == hf.config.attention_bias
    assert cfg.moe.scoring == "topk_softmax" and (cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) == (1.702, 7.0)


def test_full_prompt_logits_match_hf(case):
    full_prompt_matches_hf(*case)


@pytest.mark.parametrize("chunk", [None, 3, 5, 7])
def test_chunked_prefill_and_decode_past_window_match_hf(case, chunk):
    chunks_and_decode_past_window_match_hf(*case, chunk)


def test_batched_decode_rows_of_different_lengths_match_hf(case):
    batched_decode_rows_match_hf(*case)


def test_greedy_generation_matches_hf_generate(case):
    greedy_matches_hf_generate(*case)


def _config(tmp_path: Path, **changes) -> Path:
    path = save(hf_gpt_oss(num_hidden_layers=2, sliding_window=4), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | changes))
    return path


def test_mxfp4_checkpoint_is_refused(tmp_path):
    """Hub GPT-OSS checkpoints store the experts in MXFP4 (quantization_config): refused."""
    path = _config(tmp_path, quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ConfigError, match="quantized checkpoints are not supported.*mxfp4"):
        load_model(path)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(layer_types=["sliding_attention", "chunked_attention"]), "unsupported layer types"),
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
        (dict(sliding_window=None), "sliding_window"),
    ],
)
def test_bad_attention_configs_are_refused(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match):
        model_config_of(_config(tmp_path, **changes))


def test_tiny_gpt_oss_preset(tmp_path):
    """Reproducible, HF's config, sizes that split over TP 4, HF's greedy tokens past the window."""
    cfg = preset_is_reproducible_and_matches_hf("tiny-gpt-oss", tmp_path, transformers.GptOssForCausalLM)
    assert (cfg.num_layers, cfg.sliding_layers, cfg.sliding_window, cfg.hidden_size) == (4, (0, 2), 32, 128)
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (8, 2)
    assert all(n % 4 == 0 for n in (cfg.num_heads, cfg.num_kv_heads, cfg.moe.expert_intermediate_size))


def test_bf16_load_keeps_norms_fp32_and_tracks_fp32(case, tmp_path):
    """As HF keeps GPT-OSS's norms in fp32; bf16 logits stay near the fp32 ones at most positions
    (a few differ more where bf16 rounding flips an expert choice, in HF's bf16 model alike)."""
    hf, ours = case
    half = load_model(save(hf, tmp_path / "m"), dtype="bfloat16")
    assert half.norm.weight.dtype == torch.float32
    assert all(layer.input_layernorm.weight.dtype == torch.float32 for layer in half.layers)
    assert half.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = prompt_ids(30, seed=7)
    got = incremental_logits(half, ids, prompt_len=13, page_size=4, chunk=5)
    want = incremental_logits(ours, ids, prompt_len=13, page_size=4, chunk=5)
    assert got.dtype == torch.float32
    assert (got - want).abs().amax(dim=-1).median() < 0.05 * want.abs().max()
