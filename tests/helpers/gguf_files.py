"""Helpers for the GGUF tests: small GGUF files written with gguf.GGUFWriter the way llama.cpp's
convert_hf_to_gguf.py writes them (llama.cpp names, q/k rows permuted for llama), from random
HF-layout weights, and what kvpipe should read back from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

Q = GGMLQuantizationType

# HF -> llama.cpp per-layer names, written out here (not taken from kvpipe) so the test checks the map
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}

# tokenizer: three CONTROL tokens, one USER_DEFINED, the 256 byte tokens, a few merges
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<think>"
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġa n", "Ġan d", "1 2", "12 3", "4 5"]


def byte_alphabet() -> list[str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def vocab() -> tuple[list[str], list[int]]:
    tokens = [*SPECIALS, USER_TOKEN, *byte_alphabet(), *("".join(m.split(" ")) for m in MERGES)]
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.USER_DEFINED] + [TokenType.NORMAL] * (len(tokens) - 4)
    return tokens, [int(t) for t in types]


@dataclass
class Shape:
    hidden: int = 256  # K-quant blocks hold 256 values: rows must be a multiple
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 256
    layers: int = 2
    vocab: int = len(vocab()[0])


def hf_weights(family: str, s: Shape, seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights in HF layout ([out, in]) for a llama / qwen2 / qwen3 model."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.5

    out = {"model.embed_tokens.weight": w(s.vocab, s.hidden), "model.norm.weight": w(s.hidden)}
    if not tied:
        out["lm_head.weight"] = w(s.vocab, s.hidden)
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": w(s.hidden),
            p + "post_attention_layernorm.weight": w(s.hidden),
            p + "self_attn.q_proj.weight": w(s.heads * s.head_dim, s.hidden),
            p + "self_attn.k_proj.weight": w(s.kv_heads * s.head_dim, s.hidden),
            p + "self_attn.v_proj.weight": w(s.kv_heads * s.head_dim, s.hidden),
            p + "self_attn.o_proj.weight": w(s.hidden, s.heads * s.head_dim),
            p + "mlp.gate_proj.weight": w(s.ffn, s.hidden),
            p + "mlp.up_proj.weight": w(s.ffn, s.hidden),
            p + "mlp.down_proj.weight": w(s.hidden, s.ffn),
        }
        if family == "qwen2":
            out |= {
                p + f"self_attn.{x}_proj.bias": w(n * s.head_dim) for x, n in zip("qkv", (s.heads, *[s.kv_heads] * 2))
            }
        if family == "qwen3":
            out |= {p + "self_attn.q_norm.weight": w(s.head_dim), p + "self_attn.k_norm.weight": w(s.head_dim)}
    return out


def gguf_name(hf: str) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{LAYER_NAMES[rest]}"


def llama_permute(rows: int, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute as a gather: file row j holds HF row perm[j]."""
    return np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(rows)


def store(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """What the file holds for `w` stored as `qtype`. The K-quants have no quantizer in gguf-py:
    random blocks then, with every byte below 0x3C so each f16 scale is finite and below 1."""
    if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        block, size = GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 0x3C, (w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
    return quantize(w, qtype)


@dataclass
class Written:
    path: Path
    expected: dict[str, np.ndarray]  # HF name -> what a correct reader returns (float32, HF layout)
    original: dict[str, np.ndarray]  # the weights before quantization
    stored_types: dict[str, Q] = field(default_factory=dict)


def write_gguf(
    path: Path,
    family: str = "llama",
    qtype: Q = Q.F32,
    s: Shape | None = None,
    tied: bool = True,
    meta: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    arch: str | None = None,
) -> Written:
    """A GGUF of a random `family` model: 2-D weights stored as `qtype`, 1-D ones as F32 (as
    llama.cpp does), llama's q/k rows permuted. `meta` adds or overrides metadata (None removes)."""
    s = s or Shape()
    arch = arch or family
    rng = np.random.default_rng(1)
    weights = hf_weights(family, s, tied=tied)
    w = GGUFWriter(str(path), arch)
    for key, value in {**default_meta(arch, s), **(meta or {})}.items():
        if value is not None:
            _add(w, key, value)
    written = Written(path, {}, weights)
    for hf, x in weights.items():
        order = None
        if family == "llama" and ".q_proj." in hf:
            order = llama_permute(x.shape[0], s.heads)
        elif family == "llama" and ".k_proj." in hf:
            order = llama_permute(x.shape[0], s.kv_heads)
        file_x = x if order is None else x[order]
        kind = qtype if x.ndim == 2 else Q.F32
        data = store(file_x, kind, rng) if kind != Q.F32 else file_x
        w.add_tensor(gguf_name(hf), data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
        got = dequantize(data, kind).reshape(x.shape)
        expected = np.empty_like(got)
        expected[order if order is not None else slice(None)] = got  # file row j is HF row order[j]
        written.expected[hf] = expected
        written.stored_types[hf] = kind
    for name, x in (extra_tensors or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def default_meta(arch: str, s: Shape) -> dict[str, Any]:
    tokens, types = vocab()
    m: dict[str, Any] = {
        f"{arch}.context_length": 2048,
        f"{arch}.embedding_length": s.hidden,
        f"{arch}.block_count": s.layers,
        f"{arch}.feed_forward_length": s.ffn,
        f"{arch}.attention.head_count": s.heads,
        f"{arch}.attention.head_count_kv": s.kv_heads,
        f"{arch}.rope.freq_base": 500000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.dimension_count": s.head_dim,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2" if arch.startswith("qwen") else "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }
    if s.head_dim * s.heads != s.hidden:
        m[f"{arch}.attention.key_length"] = s.head_dim
        m[f"{arch}.attention.value_length"] = s.head_dim
    return m


def _add(w: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def patch_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Overwrite the GGML type id of tensor `name` in its tensor-info record (an unknown id cannot
    be written through GGUFWriter)."""
    blob = bytearray(path.read_bytes())
    key = len(name).to_bytes(8, "little") + name.encode()
    at = blob.index(key) + len(key)
    n_dims = int.from_bytes(blob[at : at + 4], "little")
    at += 4 + 8 * n_dims
    blob[at : at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(blob))
