"""Presets: real HF checkpoints, byte-identical per seed, cached once, not degenerate."""

from __future__ import annotations

import json

import pytest

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_generation_eos, load_model
from kvpipe.model.presets import PRESETS, default_model_dir, model_path_or_preset, write_preset
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.paged_model import greedy_generate
from tests.helpers.preset_digests import digests


def test_tiny_is_byte_identical_across_writes(tiny_model_dir, tmp_path):
    again = write_preset("tiny", tmp_path / "again")
    assert digests(again) == digests(tiny_model_dir)
    other = write_preset("tiny", tmp_path / "seed1", seed=1)
    d0, d1 = digests(tiny_model_dir), digests(other)
    assert d0["model.safetensors"] != d1["model.safetensors"]
    assert {k: v for k, v in d0.items() if k != "model.safetensors"} == {
        k: v for k, v in d1.items() if k != "model.safetensors"
    }


def test_tiny_config_shape(tiny_model_dir):
    cfg = model_config_of(tiny_model_dir)
    spec = PRESETS["tiny"]
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama",
        spec.num_layers,
        128,
        4,
        2,
        32,
    )
    assert cfg.max_position_embeddings == 8192
    tok = Tokenizer.from_dir(tiny_model_dir)
    assert cfg.vocab_size == tok.vocab_size and cfg.bos_token_id == tok.bos_token_id
    assert load_generation_eos(tiny_model_dir) == (tok.token_to_id("<|eos|>"), tok.token_to_id("<|im_end|>"))


def test_bench_spec_is_realistic():
    b = PRESETS["bench"]
    assert (b.num_layers, b.hidden_size, b.num_heads) == (12, 768, 12)
    assert b.num_heads % b.num_kv_heads == 0 and b.num_heads // b.num_kv_heads <= 4


def test_greedy_generation_is_not_constant(tiny_model_dir):
    model, tok = load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)
    for prompt in ("the cat and the dog", "hello world"):
        out = greedy_generate(model, tok.encode(prompt), 32, page_size=8)
        assert len(set(out)) >= 4, out


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-minimax-m2", "tiny-deepseek-v3"])
def test_moe_presets(name, tmp_path):
    """Reproducible, the family's config, sizes that split over TP 4, routing that is not degenerate."""
    path = write_preset(name, tmp_path / "a")
    assert digests(write_preset(name, tmp_path / "b")) == digests(path)
    cfg, spec = model_config_of(path), PRESETS[name]
    assert cfg.architecture == spec.family == spec.moe.family and cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.hidden_size, cfg.num_layers) == (8, 2, 128, 4)
    assert all(n % 4 == 0 for n in (cfg.num_heads, cfg.moe.expert_intermediate_size, cfg.intermediate_size))
    assert json.loads((path / "kvpipe_preset.json").read_text())["spec"]["moe"]["family"] == spec.family
    model, tok = load_model(path), Tokenizer.from_dir(path)
    assert sum(cfg.moe.is_sparse(i) for i in range(cfg.num_layers)) >= 3
    out = greedy_generate(model, tok.encode("the cat and the dog"), 32, page_size=8)
    assert len(set(out)) >= 4, out


def test_dense_preset_marker_has_no_moe_key(tiny_model_dir):
    spec = json.loads((tiny_model_dir / "kvpipe_preset.json").read_text())["spec"]
    assert "moe" not in spec and "mla" not in spec


def test_unknown_preset(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset"):
        write_preset("huge", tmp_path)


def test_default_model_dir_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPIPE_CACHE_DIR", str(tmp_path))
    first = default_model_dir("tiny")
    assert first == tmp_path / "tiny"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir("tiny") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temporary leftovers
    # a stale format version is rewritten
    marker = first / "kvpipe_preset.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": -1}))
    assert default_model_dir("tiny") == first
    assert json.loads(marker.read_text())["version"] != -1


def test_model_path_or_preset(tmp_path, monkeypatch):
    """What benchmarks and harnesses default to (servers default to the trained model instead)."""
    monkeypatch.setenv("KVPIPE_CACHE_DIR", str(tmp_path))
    assert model_path_or_preset("/some/checkpoint") == "/some/checkpoint"  # a given path is taken as is
    assert not (tmp_path / "tiny").exists()
    assert model_path_or_preset(None) == str(tmp_path / "tiny")  # none: the tiny preset, written once
    assert (tmp_path / "tiny" / "config.json").is_file()
