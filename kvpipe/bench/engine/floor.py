"""The hardware floor under `kvpipe bench engine`'s numbers (bookkeeping: no torch, no timing).

A decode step reads every weight it multiplies by once (and each request's KV), so its time is at
least bytes / memory bandwidth; a prefill runs 2 multiply-adds per weight per token (plus its
attention), so its time is at least FLOPs / the FMA peak of the dtype it computes in. The bench
measures both rates in the same run (bench/engine/peaks.py) and reports each point as a multiple
of its floor ("x floor": 1.0 is the hardware's limit, 1.5 means 50% above it).

What is counted, from the model's config, --dtype and --quantization:
- weights: every projection of the dense attention (q, k, v, o) and the gated MLP (gate, up,
  down) per layer, the MoE experts a batch-1 token reads (top_k routed ones + the shared expert +
  the router), and the logits' projection (the tied embedding's copy or lm_head); not the
  embedding lookup (one row a token), norms or biases (under 0.1% of the bytes);
- bytes per weight: 4 (fp32), 2 (bf16, fp16); --quantization w8a16 1 byte + a 4-byte scale per
  output row; w4a16 half a byte + two 4-byte values (scale, minimum) per 32 inputs; the logits'
  projection stays int8 in both (model/quant/quantize.py);
- KV read per decode step: each request's context at the KV dtype's item size;
- prefill FLOPs: 2 per weight per token, plus causal attention's QK^T and PV (2 * 2 * heads *
  head_dim * the keys each query sees, T (T + 1) / 2 over a prompt of T).
MLA and hybrid (linear-attention) families are not counted: their floor is None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpipe.model.checkpoint.schema import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# the KV pool's storage dtype (Engine.stats()'s kv_cache_storage_dtype, torch's names)
KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
INT4_GROUP = 32  # model/quant/weights.py GROUP


@dataclass(frozen=True)
class Matrix:
    """One weight a token multiplies by: [out, in]; `head`: the logits' projection."""

    out: int
    inp: int
    head: bool = False

    @property
    def numel(self) -> int:
        return self.out * self.inp


def decode_matrices(cfg: ModelConfig) -> list[Matrix] | None:
    """The weights one token's forward reads (the module docstring); None for MLA or hybrid models."""
    if cfg.mla is not None or cfg.hybrid is not None:
        return None
    h, d = cfg.hidden_size, cfg.head_dim
    attn = [Matrix(cfg.num_heads * d, h), Matrix(cfg.num_kv_heads * d, h), Matrix(cfg.num_kv_heads * d, h)]
    attn.append(Matrix(h, cfg.num_heads * d))
    out: list[Matrix] = []
    for layer in range(cfg.num_layers):
        out += attn
        moe = cfg.moe
        if moe is not None and moe.is_sparse(layer):
            out.append(Matrix(moe.num_experts, h))  # the router
            sizes = [moe.expert_intermediate_size] * moe.top_k
            sizes += [moe.shared_intermediate_size] if moe.shared_intermediate_size else []
        else:
            sizes = [cfg.intermediate_size]
        for inter in sizes:
            out += [Matrix(inter, h), Matrix(inter, h), Matrix(h, inter)]
    out.append(Matrix(cfg.vocab_size, h, head=True))
    return out


def matrix_bytes(m: Matrix, dtype: str, quantization: str | None) -> float:
    """Bytes of one weight as the kernels read it (the module docstring's table)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"no byte size for dtype {dtype!r}")
    mode = "w8a16" if m.head and quantization is not None else quantization
    if mode is None:
        return float(m.numel * DTYPE_BYTES[dtype])
    if mode == "w8a16":
        return float(m.numel + 4 * m.out)
    if mode == "w4a16":
        return m.numel / 2 + 8 * m.out * -(-m.inp // INT4_GROUP)
    raise ValueError(f"unknown quantization {quantization!r}")


def weight_bytes(cfg: ModelConfig, dtype: str, quantization: str | None) -> float | None:
    """Weight bytes a batch-1 decode step reads; None where decode_matrices counts nothing."""
    mats = decode_matrices(cfg)
    return None if mats is None else sum(matrix_bytes(m, dtype, quantization) for m in mats)


def kv_bytes_per_step(cfg: ModelConfig, batch: int, context: int, kv_dtype: str) -> int:
    """KV bytes a decode step of `batch` requests over `context` tokens each reads (K and V of
    every KV layer; a sliding layer its window)."""
    item = KV_BYTES[kv_dtype]
    total = 0
    for layer in cfg.kv_layers:
        window = cfg.window(layer)
        tokens = context if window is None else min(context, window)
        total += 2 * cfg.num_kv_heads * cfg.head_dim * tokens
    return batch * total * item


def prefill_flops(cfg: ModelConfig, prompt_len: int, batch: int = 1) -> float | None:
    """FLOPs of prefilling `batch` prompts of `prompt_len` tokens (the module docstring)."""
    mats = decode_matrices(cfg)
    if mats is None:
        return None
    dense = 2.0 * sum(m.numel for m in mats) * prompt_len
    pairs = prompt_len * (prompt_len + 1) / 2  # (query, key) pairs of a causal prompt
    attn = 4.0 * cfg.num_heads * cfg.head_dim * pairs * len(cfg.kv_layers)
    return batch * (dense + attn)


@dataclass(frozen=True)
class Peaks:
    """Rates measured in the run: memory read bandwidth (bytes/s) and matmul FLOP/s in the run's
    compute dtype."""

    bandwidth: float
    flops: float
    dtype: str

    def best(self, other: Peaks) -> Peaks:
        """The higher of two measurements of each rate (a floor is the best the hardware did: a
        shared machine only ever slows a measurement down)."""
        if other.dtype != self.dtype:
            raise ValueError(f"peaks of {self.dtype} and {other.dtype} do not combine")
        return Peaks(max(self.bandwidth, other.bandwidth), max(self.flops, other.flops), self.dtype)


def decode_floor_ms(weights: float | None, kv: int, peaks: Peaks) -> float | None:
    """The shortest a decode step can take: its bytes over the measured bandwidth."""
    return None if weights is None else 1000.0 * (weights + kv) / peaks.bandwidth


def prefill_floor_ms(flops: float | None, peaks: Peaks) -> float | None:
    """The shortest a prefill can take: its FLOPs at the measured matmul peak."""
    return None if flops is None else 1000.0 * flops / peaks.flops


def times_floor(measured_ms: float, floor_ms: float | None) -> float | None:
    """measured / floor (>= 1 in a sound measurement; 1.0 is the hardware's limit)."""
    return None if floor_ms is None or floor_ms <= 0 else measured_ms / floor_ms


def prefill_floor_fields(row: dict[str, Any], cfg: ModelConfig, peaks: Peaks) -> dict[str, Any]:
    """A prefill row (stats.summarize_prefill) with its floor: floor_ms and x_floor (None where the
    family is not counted)."""
    floor = prefill_floor_ms(prefill_flops(cfg, row["prompt_len"], row["batch"]), peaks)
    return {**row, "floor_ms": floor, "x_floor": times_floor(row["ms_per_prefill"], floor)}


def decode_floor_fields(
    row: dict[str, Any], cfg: ModelConfig, peaks: Peaks, dtype: str, quantization: str | None, kv_dtype: str
) -> dict[str, Any]:
    """A decode row (stats.summarize_decode) with its floor: the weight and KV bytes of a step,
    floor_ms and x_floor. The KV of a step: its context plus the warm-up steps and half the timed
    ones (the mean context over the timed steps)."""
    weights = weight_bytes(cfg, dtype, quantization)
    context = row["context"] + row["warmup_steps"] + row["steps"] // 2
    kv = kv_bytes_per_step(cfg, row["batch"], context, kv_dtype)
    floor = decode_floor_ms(weights, kv, peaks)
    fields = {"weight_bytes": weights, "kv_bytes": kv, "floor_ms": floor}
    return {**row, **fields, "x_floor": times_floor(row["ms_per_step"], floor)}


def peaks_section(peaks: Peaks) -> dict[str, Any]:
    """The report's record of the rates the floors were computed from."""
    return {"bandwidth_gb_s": peaks.bandwidth / 1e9, "matmul_tflop_s": peaks.flops / 1e12, "dtype": peaks.dtype}
