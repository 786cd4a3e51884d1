"""Loader: clear ConfigErrors for what kvpipe cannot load (a TP split that does not divide
included); generation EOS ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.loader import check_checkpoint, load_generation_eos, load_model


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_loads_tiny_with_expected_shapes(tiny_model_dir):
    m = load_model(tiny_model_dir)
    assert m.cfg.architecture == "llama" and m.num_layers == 4 and m.local_kv_heads == 2
    assert m.layers[0].self_attn.o_proj.dense_weight().shape == (128, 4 * 32)
    # q/k/v rows fused after loading (fused_projections.py), k's 2 heads after q's 4
    assert m.layers[0].self_attn.qkv.dense_weight().shape == ((4 + 2 + 2) * 32, 128)
    assert not any(p.requires_grad for p in m.parameters())


def test_unsupported_architecture(model_copy):
    edit_config(model_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(model_copy)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ConfigError, match="no such file or directory.*a .gguf file"):
        load_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)


def test_hub_id_says_kvpipe_reads_local_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the id is a relative path that does not exist here
    with pytest.raises(
        ConfigError, match="hub id.*reads local files.*kvpipe models fetch.*huggingface-cli download Qwen/"
    ):
        check_checkpoint("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ConfigError) as e:  # a missing absolute path is not taken for one
        check_checkpoint(tmp_path / "nope")
    assert "hub id" not in str(e.value)


def test_missing_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no model.safetensors"):
        load_model(model_copy)


def test_missing_tensor_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ConfigError, match=r"lacks 1 tensors.*model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(model_copy)


def test_missing_lm_head_when_untied(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["lm_head.weight"]
    save_file(tensors, path)
    with pytest.raises(ConfigError, match="lm_head.weight"):
        load_model(model_copy)
    edit_config(model_copy, tie_word_embeddings=True)  # tied: lm_head is the embedding
    m = load_model(model_copy)
    assert m.lm_head is None


def test_missing_shard_file(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "model.norm.weight": "model-00001-of-00002.safetensors",
            "model.embed_tokens.weight": "model-00002-of-00002.safetensors",
        }
    }
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors"):
        load_model(model_copy)


def test_shape_mismatch(model_copy):
    edit_config(model_copy, intermediate_size=128)
    with pytest.raises(ConfigError, match="has shape"):
        load_model(model_copy)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling type 'dynamic'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_options(model_copy, changes, match):
    edit_config(model_copy, **changes)
    with pytest.raises(ConfigError, match=match):
        load_model(model_copy)


def test_dtype_choice(tiny_model_dir):
    assert load_model(tiny_model_dir, dtype=torch.float16).embed_tokens.dtype == torch.float16
    with pytest.raises(ConfigError, match="dtype"):
        load_model(tiny_model_dir, dtype="int8")


def test_generation_eos_merges_both_files(model_copy):
    gen = json.loads((model_copy / "generation_config.json").read_text())
    cfg = json.loads((model_copy / "config.json").read_text())
    assert load_generation_eos(model_copy) == tuple(gen["eos_token_id"])  # config's id is among them
    assert cfg["eos_token_id"] in gen["eos_token_id"]
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_generation_eos(model_copy) == (7, cfg["eos_token_id"])
    (model_copy / "generation_config.json").unlink()
    assert load_generation_eos(model_copy) == (cfg["eos_token_id"],)


def test_tp_rejects_indivisible_split(tiny_model_dir):
    with pytest.raises(ConfigError, match="tp_size=3"):
        load_model(tiny_model_dir, ParallelConfig(3, 0))
    with pytest.raises(ConfigError, match="tp_rank"):
        load_model(tiny_model_dir, ParallelConfig(2, 2))
    with pytest.raises(ConfigError, match="torch.distributed"):
        load_model(tiny_model_dir, ParallelConfig(2, 0))  # no process group in this process


def test_fp8_kv_scales_come_from_the_checkpoint(model_copy):
    """k_scale / v_scale tensors under the names SGLang reads (self_attn.k_scale, one kv_scale for
    both) reach an fp8 pool, layer by layer; absent: 1.0; other KV dtypes ignore them. A scale
    that is not positive is refused."""
    from kvpipe.engine.model_runner import make_kv_pool

    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([2.0])
    tensors["model.layers.2.self_attn.kv_scale"] = torch.tensor(0.25)
    save_file(tensors, path, metadata={"format": "pt"})
    m = load_model(model_copy)
    n = m.cfg.num_layers
    assert m.kv_scales.k == (0.5, 1.0, 0.25) + (1.0,) * (n - 3) and m.kv_scales.found == 2
    assert m.kv_scales.v == (2.0, 1.0, 0.25) + (1.0,) * (n - 3)
    pool = make_kv_pool(m, 4, 16, kv_cache_dtype="fp8_e4m3")
    assert (pool.k_scale, pool.v_scale) == (m.kv_scales.k, m.kv_scales.v)
    assert make_kv_pool(m, 4, 16, kv_cache_dtype="bfloat16").k_scale == (1.0,) * n
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(-1.0)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="positive"):
        load_model(model_copy)
