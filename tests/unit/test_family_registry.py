"""The family registry is the one place that knows model families: no HF or GGUF architecture
name appears in kvpipe/ outside the family files (model/families/), names are claimed once, and a
new family is its entry and nothing else (a registered copy of Llama under new names loads)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import kvpipe
from kvpipe.config import ConfigError
from kvpipe.model import registry
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import check_supported, load_model
from kvpipe.model.families.llama import LLAMA
from kvpipe.model.presets import preset_config, preset_names
from kvpipe.model.presets.writer import preset_hf_config
from kvpipe.model.registry import model_config
from tests.helpers.gguf_files import write_gguf

PACKAGE = Path(kvpipe.__file__).resolve().parent
FAMILY_FILES = PACKAGE / "model" / "families"
# an HF model class name (LlamaForCausalLM, Qwen3_5MoeForCausalLM, LlamaForCausalLMEagle, ...)
HF_CLASS = re.compile(r"[A-Z]\w*For[A-Z]\w*")
# (file, string): the same word in another namespace, not a family's name
NOT_ARCHITECTURES = {
    ("model/checkpoint/gguf/tokenizer.py", "qwen2"),  # a llama.cpp pre-tokenizer (tokenizer.ggml.pre)
    ("model/checkpoint/gguf/tokenizer.py", "llama"),  # llama.cpp's SentencePiece vocabulary (tokenizer.ggml.model)
}


def _names() -> set[str]:
    names: set[str] = set()
    for f in registry.FAMILIES.values():
        names |= {f.name, f.model_type, *f.hf_architectures}
        if f.gguf is not None:
            names.add(f.gguf.architecture)
    return names


def test_architecture_names_appear_only_in_the_family_files() -> None:
    names, offenders = _names(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        if FAMILY_FILES in path.parents:
            continue
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            if (node.value in names or HF_CLASS.fullmatch(node.value)) and (rel, node.value) not in NOT_ARCHITECTURES:
                offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert offenders == []


def test_each_name_is_claimed_by_one_family() -> None:
    fams = list(registry.FAMILIES.values())
    hf = [a for f in fams for a in f.hf_architectures]
    gguf = [f.gguf.architecture for f in fams if f.gguf is not None]
    assert len(set(hf)) == len(hf) and len(set(gguf)) == len(gguf)
    assert all(name == f.name for name, f in registry.FAMILIES.items())
    assert registry.gguf_names() == sorted(gguf)


@pytest.mark.parametrize("preset", preset_names())
def test_presets_write_their_familys_header(preset: str) -> None:
    """A preset's config.json names its family by the registry's header, and parses back to it."""
    raw = preset_hf_config(preset)
    fam = registry.hf_family(raw)
    assert {k: raw[k] for k in ("architectures", "model_type")} == fam.hf_header()
    assert preset_config(preset).architecture == fam.name


def test_unknown_architecture_names_its_model_type() -> None:
    raw = preset_hf_config("tiny") | {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
    with pytest.raises(ConfigError, match=r"unsupported architecture \['Gemma2ForCausalLM'\]: the gemma2 model family"):
        model_config(raw)


@pytest.mark.parametrize(
    "change",
    [
        {"partial_rotary_factor": 0.5},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ],
)
def test_partial_rotary_is_refused_where_the_family_lacks_it(change: dict) -> None:
    """Family.partial_rotary: a family without it refuses a half-rotated head wherever the config
    says so (transformers >= 5 writes the factor into rope_parameters); one with it reads the dims."""
    raw = preset_hf_config("tiny") | change
    with pytest.raises(ConfigError, match="partial_rotary_factor != 1 is not supported for llama"):
        check_supported(raw, model_config(raw))
    minimax = preset_hf_config("tiny-minimax-m2")
    raw = minimax | change | {"rotary_dim": minimax["head_dim"]}
    assert model_config(raw).rotary_dim == minimax["head_dim"] // 2


def test_gguf_architectures_come_from_the_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF of a family whose entry has no GGUF names is refused, naming those that have."""
    no_gguf = dataclasses.replace(registry.FAMILIES["qwen3"], gguf=None)
    monkeypatch.setitem(registry.FAMILIES, "qwen3", no_gguf)
    w = write_gguf(tmp_path / "m.gguf", "qwen3")
    others = r"\['gemma3', 'llama', 'qwen2'\]"
    with pytest.raises(ConfigError, match=r"GGUF architecture 'qwen3' is not supported.*" + others):
        model_config_of(w.path)


def test_a_new_family_is_one_entry(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's model under new names and a family hook of its own: recognised, parsed, built and
    loaded through the registry alone."""

    def toy_config(raw: dict) -> dict:
        return {"qk_norm": False, "attention_bias": False, "max_position_embeddings": 64}

    toy = dataclasses.replace(
        LLAMA, name="toy", hf_architectures=("ToyForCausalLM",), model_type="toy", config=toy_config, gguf=None
    )
    monkeypatch.setitem(registry.FAMILIES, "toy", toy)
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "toy")
    raw = json.loads((model_dir / "config.json").read_text()) | toy.hf_header()
    (model_dir / "config.json").write_text(json.dumps(raw))
    cfg = model_config_of(model_dir)
    assert cfg.architecture == "toy" and cfg.max_position_embeddings == 64
    toy_model, ref = load_model(model_dir), load_model(tiny_model_dir)
    assert toy_model.cfg == cfg
    for (name, a), (_, b) in zip(toy_model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
