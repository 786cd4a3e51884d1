"""Gemma 3 against HF transformers, fp32, on random tiny checkpoints: sliding and global layers
by its pattern or by `layer_types`, the two RoPE bases (linear scaling on the global one), the
zero-centred norms (four per layer, q/k per head), query_pre_attn_scalar, GeGLU, the tied
sqrt(hidden)-scaled embedding (untied too), final logit softcapping; the three attention paths
(tests/helpers/window_parity.py), both config formats, the refused options and the tiny-gemma3
preset. The trained 270M is test_gemma3_270m_hf_parity.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.registry import model_config

transformers = pytest.importorskip("transformers")

from tests.helpers.hf_gemma3 import CASES, hf_gemma3  # noqa: E402
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
    hf = hf_gemma3(**CASES[request.param])
    return hf, load_model(save(hf, tmp_path_factory.mktemp(request.param)))


def test_config_fields(case):
    hf, ours = case
    cfg, h = ours.cfg, hf.config
    assert cfg.architecture == "gemma3" and cfg.qk_norm and not cfg.attention_sinks
    assert cfg.sliding_layers == tuple(i for i, t in enumerate(h.layer_types) if t == "sliding_attention")
    assert cfg.sliding_window == h.sliding_window and cfg.tie_word_embeddings == h.tie_word_embeddings
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.sliding_rope_theta == 1e4 and cfg.attention_scale == 24**-0.5
    assert (cfg.hidden_act, cfg.final_logit_softcapping) == ("gelu_pytorch_tanh", h.final_logit_softcapping)


def test_full_prompt_logits_match_hf(case):
    full_prompt_matches_hf(*case)


@pytest.mark.parametrize("chunk", [None, 5])
def test_chunked_prefill_and_decode_past_window_match_hf(case, chunk):
    chunks_and_decode_past_window_match_hf(*case, chunk)


def test_batched_decode_rows_of_different_lengths_match_hf(case):
    batched_decode_rows_match_hf(*case)


def test_greedy_generation_matches_hf_generate(case):
    greedy_matches_hf_generate(*case)


def test_bf16_embedding_scale_is_rounded_like_hf(tmp_path):
    """sqrt(96) = 9.798 is 9.8125 in bf16: HF scales by the rounded value, so kvpipe does."""
    hf = hf_gemma3(hidden_size=96, num_hidden_layers=1, num_key_value_heads=2, sliding_window=4)
    ours = load_model(save(hf, tmp_path / "m"), dtype="bfloat16")
    ids = prompt_ids(9)
    got = ours.embed(ForwardBatch.build([ids], [0], [torch.arange(3)], 4))
    want = hf.to(torch.bfloat16).model.embed_tokens(torch.tensor([ids]))[0]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(got, ours.embed_tokens[ids] * 96**0.5)  # the unrounded scale differs


# The keys of google/gemma-3-270m's config.json as transformers 4.5x wrote it: flat RoPE keys
# (rope_theta and rope_scaling for the global layers, rope_local_base_freq), the pattern as a number
HUB_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 32,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 512,
    "sliding_window_pattern": 3,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
}


@pytest.mark.parametrize("drop", [(), ("rope_theta", "rope_local_base_freq", "sliding_window_pattern", "rope_scaling")])
def test_flat_configs_read_as_transformers_reads_them(drop):
    """The older flat keys (and their defaults where absent) give the layers and bases HF's config
    class derives from them."""
    raw = {k: v for k, v in HUB_CONFIG.items() if k not in drop}
    cfg, h = model_config(raw), transformers.Gemma3TextConfig(**raw)
    assert cfg.sliding_layers == tuple(i for i, t in enumerate(h.layer_types) if t == "sliding_attention")
    full, local = h.rope_parameters["full_attention"], h.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.sliding_rope_theta) == (full["rope_theta"], local["rope_theta"])
    assert cfg.rope_scaling == ({"rope_type": "linear", "factor": 8.0} if "rope_scaling" not in drop else None)
    assert full.get("rope_type", "default") == ("linear" if "rope_scaling" not in drop else "default")
    assert cfg.tie_word_embeddings and cfg.attention_scale == h.query_pre_attn_scalar**-0.5


def _config(tmp_path: Path, **changes) -> Path:
    path = save(hf_gemma3(num_hidden_layers=2, sliding_window=4), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | changes))
    return path


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(hidden_activation="gelu"), "hidden_act='gelu' is not supported for gemma3"),
        (
            dict(
                rope_parameters={
                    **hf_gemma3().config.rope_parameters,
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            ),
            "sliding layers' rope_type",
        ),  # fmt: skip
        (dict(layer_types=["sliding_attention", "chunked_attention"]), "unsupported layer types"),
        (dict(sliding_window=None), "sliding_window"),
    ],
)
def test_options_the_model_lacks_are_refused(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match):
        load_model(_config(tmp_path, **changes))


def test_tiny_gemma3_preset(tmp_path):
    """Reproducible, HF's config, sizes that split over TP 2, HF's greedy tokens past the window."""
    cfg = preset_is_reproducible_and_matches_hf("tiny-gemma3", tmp_path, transformers.Gemma3ForCausalLM)
    assert (cfg.num_layers, cfg.sliding_layers, cfg.sliding_window) == (7, (0, 1, 2, 3, 4, 6), 32)
    assert cfg.tie_word_embeddings and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert all(n % 2 == 0 for n in (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size))
    assert model_config_of(tmp_path / "a") == cfg
