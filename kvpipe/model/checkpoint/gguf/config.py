"""GGUF metadata -> the HF config dict `ModelConfig.from_hf_dict` reads.

Key names follow llama.cpp's writer (gguf.Keys) and transformers' GGUF loader
(integrations/ggml.py: GGUF_CONFIG_MAPPING), with two differences where transformers guesses:
head_dim comes from `attention.key_length` when the file states it (Qwen3 writes it; transformers
falls back on its config class default there), and rope scaling is read for every family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.reader import Metadata

# RoPE scaling types llama.cpp writes (`{arch}.rope.scaling.type`) that map onto an HF rope_scaling
_ROPE_SCALING = ("none", "linear", "yarn")


def hf_config(
    meta: Metadata,
    tensor_names: frozenset[str],
    arch: str,
    header: dict[str, Any],
    own_keys: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The config.json an HF checkpoint of this model would carry (the fields kvpipe reads): the
    `{arch}.*` keys of family `arch` (GGUFFamily.architecture) under `header`, the family's HF
    `architectures` and `model_type` (Family.hf_header); `own_keys` (GGUFFamily.config_keys): the
    family's own `{arch}.<key>` -> HF key, copied where the file has them."""

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = meta.require_int(key("embedding_length"))
    heads = meta.require_int(key("attention.head_count"))
    vocab = meta.get(key("vocab_size"))
    if vocab is None:  # older files: the vocabulary's length (as transformers does)
        vocab = len(meta.require("tokenizer.ggml.tokens"))
    cfg: dict[str, Any] = {
        **header,
        "hidden_size": hidden,
        "intermediate_size": meta.require_int(key("feed_forward_length")),
        "num_hidden_layers": meta.require_int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.int_or(key("attention.head_count_kv"), heads),
        "head_dim": _head_dim(meta, key, hidden // heads),
        "rms_norm_eps": meta.require_float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": meta.require_int(key("context_length")),
        "vocab_size": int(vocab),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",  # weights are dequantized; the engine picks its own dtype
    }
    for gguf_key, hf_key in (own_keys or {}).items():
        value = meta.get(key(gguf_key))
        if value is not None:
            cfg[hf_key] = value
    scaling = _rope_scaling(meta, key)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    cfg.update(_special_ids(meta))
    return cfg


def _head_dim(meta: Metadata, key: Callable[[str], str], default: int) -> int:
    """attention.key_length if given, else hidden // heads. The rotary width must be the whole head
    (the llama/qwen models rotate all of it) and values as wide as keys."""
    head_dim = meta.int_or(key("attention.key_length"), default)
    value_len = meta.get(key("attention.value_length"))
    if value_len is not None and int(value_len) != head_dim:
        raise ConfigError(f"{meta.path}: attention.value_length {value_len} != key_length {head_dim} is not supported")
    rotary = meta.get(key("rope.dimension_count"))
    if rotary is not None and int(rotary) != head_dim:
        raise ConfigError(
            f"{meta.path}: rope.dimension_count {rotary} != head_dim {head_dim} (partial rotary) is not supported"
        )
    return head_dim


def _rope_scaling(meta: Metadata, key: Callable[[str], str]) -> dict[str, Any] | None:
    """`{arch}.rope.scaling.*` as an HF rope_scaling dict (linear or yarn), None without scaling."""
    prefix = key("rope.scaling.")
    kind = meta.get(prefix + "type", "none")
    if kind not in _ROPE_SCALING:
        raise ConfigError(f"{meta.path}: rope scaling type {kind!r} is not supported (only {_ROPE_SCALING})")
    factor = meta.get(prefix + "factor")
    if kind == "none" or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if kind == "yarn":
        original = meta.get(prefix + "original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = meta.get(prefix + gguf_key)
            if value is not None:
                scaling[hf_key] = float(value)
        # llama.cpp's attn_factor multiplies the magnitude correction HF derives from `factor`;
        # anything but the neutral 1.0 would change logits silently, so it is refused
        attn = meta.get(prefix + "attn_factor")
        if attn is not None and float(attn) != 1.0:
            raise ConfigError(f"{meta.path}: yarn rope.scaling.attn_factor={attn} is not supported")
    return scaling


def _special_ids(meta: Metadata) -> dict[str, Any]:
    """bos/eos/pad ids; eos as a list when the file also names an end-of-turn (eot/eom) token, so
    generation stops on either (as llama.cpp stops on every end-of-generation token)."""
    out: dict[str, Any] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = int(bos)
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        out["pad_token_id"] = int(pad)
    eos = eos_token_ids(meta)
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
    return out


def eos_token_ids(meta: Metadata) -> tuple[int, ...]:
    ids = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))
