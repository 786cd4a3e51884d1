"""Built-in models: deterministic random weights written as real HF checkpoint directories.

`tiny` makes tests run in seconds; `bench` has a realistic KV-bytes-to-compute ratio for the
transfer benchmarks. Every file is a pure function of (preset, seed): byte-identical across runs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvpipe.config import ConfigError
from kvpipe.model import presets_qwen3_5
from kvpipe.model.preset_tokenizer import SPECIAL_TOKENS, build_tokenizer

PRESET_FORMAT_VERSION = 1  # bump when a preset's files change, so cached copies are rewritten

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class PresetSpec:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False  # untied: a tied random model mostly echoes its input token
    weight_std: float = 0.02
    embed_std: float = 1.0


PRESETS: dict[str, PresetSpec] = {
    "tiny": PresetSpec(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                       intermediate_size=256),
    # tiny with one KV head per query head: every TP pairing up to 4 slices heads (staging tests)
    "tiny-kv4": PresetSpec(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=32,
                           intermediate_size=256),
    # GPT-2-small-sized stack with mild GQA (3 query heads per KV head), fp32.
    "bench": PresetSpec(num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, head_dim=64,
                        intermediate_size=2048),
}


def _hf_config(spec: PresetSpec, vocab_size: int, bos: int, eos: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta, "rope_scaling": None,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32", "use_cache": True,
    }


def _weights(spec: PresetSpec, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size

    def rnd(*shape: int, std: float = spec.weight_std) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    w = {"model.embed_tokens.weight": rnd(vocab_size, h, std=spec.embed_std)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = rnd(spec.num_heads * d, h)
        w[p + "self_attn.k_proj.weight"] = rnd(spec.num_kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = rnd(spec.num_kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, spec.num_heads * d)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
    w["model.norm.weight"] = torch.ones(h)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = rnd(vocab_size, h)
    return w


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_preset(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write preset `name` as an HF checkpoint directory into out_dir (created); returns it."""
    hybrid = presets_qwen3_5.QWEN3_5_PRESETS
    if name not in PRESETS and name not in hybrid:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS) + sorted(hybrid)}")
    spec = PRESETS[name] if name in PRESETS else hybrid[name]
    config_fn, weights_fn = (_hf_config, _weights) if name in PRESETS else (presets_qwen3_5.hf_config,
                                                                            presets_qwen3_5.weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    bos, eos, im_end = ids["<|bos|>"], ids["<|eos|>"], ids["<|im_end|>"]
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    _dump(out / "tokenizer_config.json", {
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
    })
    _dump(out / "config.json", config_fn(spec, vocab, bos, eos))
    _dump(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": [eos, im_end],
                                           "do_sample": False})
    save_file(weights_fn(spec, vocab, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    _dump(out / "kvpipe_preset.json", {"preset": name, "seed": seed, "version": PRESET_FORMAT_VERSION,
                                       "spec": asdict(spec)})
    return out


def cache_root() -> Path:
    env = os.environ.get("KVPIPE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvpipe" / "models"


def _is_current(path: Path, name: str, seed: int) -> bool:
    marker = path / "kvpipe_preset.json"
    if not marker.is_file():
        return False
    meta = json.loads(marker.read_text())
    return meta.get("preset") == name and meta.get("seed") == seed and meta.get("version") == PRESET_FORMAT_VERSION


def default_model_dir(preset: str, seed: int = 0) -> Path:
    """Cached checkpoint of `preset` under $KVPIPE_CACHE_DIR or ~/.cache/kvpipe/models/<preset>.

    Written once into a temporary sibling and renamed into place, so concurrent callers never
    see a half-written directory.
    """
    root = cache_root()
    target = root / (preset if seed == 0 else f"{preset}-seed{seed}")
    if _is_current(target, preset, seed):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_preset(preset, tmp, seed)
        if target.exists() and not _is_current(target, preset, seed):
            shutil.rmtree(target, ignore_errors=True)  # stale format version
        try:
            tmp.rename(target)
        except OSError:
            if not _is_current(target, preset, seed):  # lost a race to a writer that failed
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(path: str | None) -> str:
    """A --model-path, or the built-in tiny preset (written once, then reused) when none is given."""
    return path if path else str(default_model_dir("tiny"))
