"""Every preset by name, and writing one as an HF checkpoint directory: tokenizer files,
config.json, generation_config.json, model.safetensors and kvpipe_preset.json (the preset, its
seed, PRESET_FORMAT_VERSION and its spec). Every file is a pure function of (preset, seed):
byte-identical across runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import kvpipe.model.presets.gemma3 as presets_gemma3
import kvpipe.model.presets.gpt_oss as presets_gpt_oss
import kvpipe.model.presets.llama as presets_llama
import kvpipe.model.presets.qwen3_5 as presets_qwen3_5
from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.presets.tokenizer import SPECIAL_TOKENS, build_tokenizer
from kvpipe.model.registry import model_config

PRESET_FORMAT_VERSION = 4  # bump when a preset's files change, so cached copies are rewritten (4: Qwen3.5 MTP layers)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# a preset's spec, its HF config.json (spec, vocab, bos, eos) and its tensors (spec, vocab, seed)
_Writer = tuple[Any, Callable[..., dict], Callable[..., dict[str, torch.Tensor]]]


def _writers() -> dict[str, _Writer]:
    """Every preset by name; the family presets keep their own spec types."""
    return {
        **{n: (s, presets_llama.hf_config, presets_llama.weights) for n, s in presets_llama.PRESETS.items()},
        **{
            n: (s, presets_qwen3_5.hf_config, presets_qwen3_5.weights)
            for n, s in presets_qwen3_5.QWEN3_5_PRESETS.items()
        },
        **{
            n: (s, presets_gpt_oss.hf_config, presets_gpt_oss.weights)
            for n, s in presets_gpt_oss.GPT_OSS_PRESETS.items()
        },
        **{n: (s, presets_gemma3.hf_config, presets_gemma3.weights) for n, s in presets_gemma3.GEMMA3_PRESETS.items()},
    }


def preset_names() -> list[str]:
    return sorted(_writers())


def _writer(name: str) -> _Writer:
    writers = _writers()
    if name not in writers:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(writers)}")
    return writers[name]


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_preset(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write preset `name` as an HF checkpoint directory into out_dir (created); returns it."""
    spec, config_fn, weights_fn = _writer(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    bos, eos, im_end = ids["<|bos|>"], ids["<|eos|>"], ids["<|im_end|>"]
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    _dump(
        out / "tokenizer_config.json",
        {
            "bos_token": "<|bos|>",
            "eos_token": "<|eos|>",
            "pad_token": "<|pad|>",
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": spec.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        },
    )
    _dump(out / "config.json", config_fn(spec, vocab, bos, eos))
    _dump(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": [eos, im_end], "do_sample": False})
    save_file(weights_fn(spec, vocab, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    _dump(
        out / "kvpipe_preset.json",
        {"preset": name, "seed": seed, "version": PRESET_FORMAT_VERSION, "spec": _spec_json(spec)},
    )
    return out


def _spec_json(spec: Any) -> dict:
    """The spec as written into kvpipe_preset.json; a dense preset's has no `moe` key and a non-MLA
    one no `mla` key, so the files of the presets older than the MoE/MLA ones stay byte-identical."""
    out = asdict(spec)
    for key in ("moe", "mla"):
        if key in out and out[key] is None:
            del out[key]
    return out


def preset_hf_config(name: str) -> dict[str, Any]:
    """The config.json preset `name` is written with, but for its bos/eos ids (0 and 1 here)."""
    spec, config_fn, _ = _writer(name)
    return config_fn(spec, build_tokenizer().get_vocab_size(with_added_tokens=True), 0, 1)


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig preset `name` would be written with (its KV and state shapes, without
    writing weights); any family's preset."""
    return model_config(preset_hf_config(name))
