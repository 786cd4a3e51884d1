"""Built-in models: deterministic random weights written as real HF checkpoint directories.

`tiny` makes tests run in seconds; `bench` has a realistic KV-bytes-to-compute ratio for the
transfer benchmarks; `tiny-qwen3-moe` and `tiny-minimax-m2` are tiny sparse-MoE models and
`tiny-deepseek-v3` a tiny MLA + MoE model, written with the tensor names of those families' hub
checkpoints. Every file is a pure function of (preset, seed): byte-identical across runs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvpipe.config import ConfigError
from kvpipe.model.config import ModelConfig
from kvpipe.model.presets import gpt_oss as presets_gpt_oss
from kvpipe.model.presets import qwen3_5 as presets_qwen3_5
from kvpipe.model.presets.deepseek import MLAPresetSpec, deepseek_v3_config, mla_attention_weights
from kvpipe.model.presets.tokenizer import SPECIAL_TOKENS, build_tokenizer

PRESET_FORMAT_VERSION = 1  # bump when a preset's files change, so cached copies are rewritten

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class MoEPresetSpec:
    """The sparse part of an MoE preset; its family decides the HF config and tensor names."""

    family: str  # "qwen3_moe" | "minimax_m2" | "deepseek_v3"
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    # a dense MLP of intermediate_size: Qwen3-MoE mlp_only_layers, DeepSeek-V3 the first_k_dense_replace first
    dense_layers: tuple[int, ...] = ()
    rotary_dim: int | None = None  # MiniMax-M2 partial rotary: the rotated dims of each head
    bias_std: float = 0.05  # MiniMax-M2 / DeepSeek-V3 e_score_correction_bias: nonzero, so it steers the routing
    # DeepSeek-V3: group-limited routing, shared experts (of expert_intermediate_size each), weight scale
    num_groups: int = 1
    topk_groups: int = 1
    shared_experts: int = 0
    routed_scaling_factor: float = 1.0


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
    moe: MoEPresetSpec | None = None  # None: a dense Llama
    mla: MLAPresetSpec | None = None  # latent attention (DeepSeek-V3); num_kv_heads is then unused

    @property
    def family(self) -> str:
        return "llama" if self.moe is None else self.moe.family


PRESETS: dict[str, PresetSpec] = {
    "tiny": PresetSpec(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256),
    # tiny with one KV head per query head: every TP pairing up to 4 slices heads (staging tests)
    "tiny-kv4": PresetSpec(
        num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=32, intermediate_size=256
    ),
    # GPT-2-small-sized stack with mild GQA (3 query heads per KV head), fp32.
    "bench": PresetSpec(
        num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2048
    ),
    # MoE presets: 8 experts, top-2; every size splits over TP 4
    "tiny-qwen3-moe": PresetSpec(
        num_layers=4,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe=MoEPresetSpec("qwen3_moe", num_experts=8, top_k=2, expert_intermediate_size=64, dense_layers=(0,)),
    ),
    "tiny-minimax-m2": PresetSpec(
        num_layers=4,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=64,
        moe=MoEPresetSpec("minimax_m2", num_experts=8, top_k=2, expert_intermediate_size=64, rotary_dim=16),
    ),
    # MLA (latent 32 + rope 16 per token and layer, q LoRA 64, yarn x4) + MoE (layer 0 dense, then
    # 8 experts in 2 groups, top-2 from the best group, 1 shared expert); every size splits over TP 4
    "tiny-deepseek-v3": PresetSpec(
        num_layers=4,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=8,
        head_dim=16,
        intermediate_size=256,
        moe=MoEPresetSpec(
            "deepseek_v3",
            num_experts=8,
            top_k=2,
            expert_intermediate_size=64,
            dense_layers=(0,),
            num_groups=2,
            topk_groups=1,
            shared_experts=1,
            routed_scaling_factor=2.5,
        ),
        mla=MLAPresetSpec(
            q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, yarn_factor=4.0
        ),
    ),
}


def _hf_config(spec: PresetSpec, vocab_size: int, bos: int, eos: int) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    moe = spec.moe
    if moe is None:
        return cfg
    for key in ("rope_scaling", "mlp_bias"):  # not options of the MoE families' HF configs
        del cfg[key]
    if moe.family == "qwen3_moe":
        return cfg | {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(moe.dense_layers),
            "use_sliding_window": False,
        }
    if moe.family == "minimax_m2":
        if spec.intermediate_size != moe.expert_intermediate_size or moe.dense_layers:
            raise ConfigError("MiniMax-M2 has no dense layers: intermediate_size is the expert size")
        return cfg | {
            "architectures": ["MiniMaxM2ForCausalLM"],
            "model_type": "minimax_m2",
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "rotary_dim": moe.rotary_dim or spec.head_dim,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
        }
    if moe.family == "deepseek_v3" and spec.mla is not None:
        return cfg | deepseek_v3_config(spec.num_layers, spec.num_heads, spec.head_dim, spec.mla, moe)
    raise ConfigError(f"unknown MoE preset family {moe.family!r}")


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
        if spec.mla is not None:
            w.update(mla_attention_weights(h, spec.num_heads, spec.mla, i, rnd))
        else:
            w[p + "self_attn.q_proj.weight"] = rnd(spec.num_heads * d, h)
            w[p + "self_attn.k_proj.weight"] = rnd(spec.num_kv_heads * d, h)
            w[p + "self_attn.v_proj.weight"] = rnd(spec.num_kv_heads * d, h)
            w[p + "self_attn.o_proj.weight"] = rnd(h, spec.num_heads * d)
        if spec.moe is None:
            w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
            w[p + "mlp.up_proj.weight"] = rnd(inter, h)
            w[p + "mlp.down_proj.weight"] = rnd(h, inter)
        else:
            w.update(_moe_layer_weights(spec, spec.moe, i, rnd))
    w["model.norm.weight"] = torch.ones(h)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = rnd(vocab_size, h)
    return w


def _moe_layer_weights(
    spec: PresetSpec, moe: MoEPresetSpec, layer: int, rnd: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Layer `layer`'s q/k norms (none for DeepSeek-V3's MLA) and MLP (dense or sparse) under the
    family's hub tensor names."""
    h, d, p = spec.hidden_size, spec.head_dim, f"model.layers.{layer}."
    per_head = moe.family == "qwen3_moe"  # MiniMax-M2 norms the whole q / k projection
    mixtral_names = moe.family == "minimax_m2"
    w = (
        {}
        if moe.family == "deepseek_v3"
        else {
            p + "self_attn.q_norm.weight": torch.ones(d if per_head else spec.num_heads * d),
            p + "self_attn.k_norm.weight": torch.ones(d if per_head else spec.num_kv_heads * d),
        }
    )
    if layer in moe.dense_layers:
        inter = spec.intermediate_size
        return w | {
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
        }
    inter = moe.expert_intermediate_size
    # (gate, up, down) names per family: Qwen3-MoE's and DeepSeek-V3's mirror the dense MLP,
    # MiniMax-M2's are Mixtral's
    block, names = (
        ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral_names else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    w[p + f"{block}.gate.weight"] = rnd(moe.num_experts, h)
    if moe.family == "minimax_m2":
        w[p + f"{block}.e_score_correction_bias"] = rnd(moe.num_experts, std=moe.bias_std)
    if moe.family == "deepseek_v3":
        w[p + "mlp.gate.e_score_correction_bias"] = rnd(moe.num_experts, std=moe.bias_std)
    for e in range(moe.num_experts):
        q = p + f"{block}.experts.{e}."
        w[q + f"{names[0]}.weight"] = rnd(inter, h)
        w[q + f"{names[1]}.weight"] = rnd(inter, h)
        w[q + f"{names[2]}.weight"] = rnd(h, inter)
    if moe.shared_experts:  # DeepSeek-V3: one fused shared MLP of shared_experts * expert size
        shared = moe.shared_experts * inter
        q = p + "mlp.shared_experts."
        w[q + "gate_proj.weight"], w[q + "up_proj.weight"] = rnd(shared, h), rnd(shared, h)
        w[q + "down_proj.weight"] = rnd(h, shared)
    return w


def _spec_json(spec: PresetSpec) -> dict:
    """The spec as written into kvpipe_preset.json; a dense preset's has no `moe` key and a non-MLA
    one no `mla` key, so the files of the presets older than the MoE/MLA ones stay byte-identical."""
    out = asdict(spec)
    for key in ("moe", "mla"):
        if key in out and out[key] is None:
            del out[key]
    return out


# a preset's spec, its HF config.json (spec, vocab, bos, eos) and its tensors (spec, vocab, seed)
_Writer = tuple[Any, Callable[..., dict], Callable[..., dict[str, torch.Tensor]]]


def _writers() -> dict[str, _Writer]:
    """Every preset by name; the family presets keep their own spec types."""
    return {
        **{n: (s, _hf_config, _weights) for n, s in PRESETS.items()},
        **{
            n: (s, presets_qwen3_5.hf_config, presets_qwen3_5.weights)
            for n, s in presets_qwen3_5.QWEN3_5_PRESETS.items()
        },
        **{
            n: (s, presets_gpt_oss.hf_config, presets_gpt_oss.weights)
            for n, s in presets_gpt_oss.GPT_OSS_PRESETS.items()
        },
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


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig preset `name` would be written with (its KV and state shapes, without
    writing weights); any family's preset."""
    spec, config_fn, _ = _writer(name)
    tok = build_tokenizer()
    return ModelConfig.from_hf_dict(config_fn(spec, tok.get_vocab_size(with_added_tokens=True), 0, 1))
