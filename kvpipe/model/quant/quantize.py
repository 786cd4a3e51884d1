"""--quantization: which weights of a loaded model become weight-only int8/int4
(quantized_weight.py), and what each is made from.

- w8a16: every Linear of the decoder layers (q/k/v/o, gate/up/down; an untied lm_head too) as
  int8 per output row, from its loaded values (an untied lm_head is int8 under w4a16 too). A GGUF
  Q8_0 tensor has a scale per block of 32, the kernel one per row: it is dequantized and
  requantized per row (one more rounding, not a straight load).
- w4a16: those Linears as int4 in groups of 32. GGUF Q4_0/Q4_1 tensors load straight: their codes,
  scales and minimums become the kernel's (blocks.py), so the weights are the file's exactly;
  other tensors are quantized like Q4_1 (min/max per group) from their values. A Linear whose
  input count is not a multiple of 32 is int8 instead.
- In both modes, tied embeddings keep the dense table for the lookup and get an int8 per-row copy
  for the logits (as llama.cpp does: SmolLM2's Q4_1 file stores token_embd, its tied output, as
  Q8_0, and llama.cpp's Q8_0 conversion keeps it at Q8_0).
The quantized matmuls run in fp32 on the dequantized weights (quantized_weight.py,
cpu/kernels/weight_only.cpp); norms, embeddings, attention, residuals and the KV cache stay in --dtype.

Every TP rank quantizes its own shard to the weights TP 1 would have: a row-parallel (column)
shard takes its int8 row scales from the whole checkpoint row (`whole`), and its int4 groups are
TP 1's where its column ranges start and end on multiples of 32 (a GGUF shard that cuts a block
falls back to quantizing its dequantized values). Sparse (MoE) experts, MLA's latent projections
and hybrid models' linear-attention layers are not plain Linears here: such models are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kvpipe.config import QUANTIZATIONS, ConfigError
from kvpipe.model.checkpoint.gguf.blocks import BLOCK, INT4_BLOCK_TYPES, q4_codes
from kvpipe.model.checkpoint.gguf.tensors import GGUFTensor
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.families.causal_lm import LMBase
from kvpipe.model.layers.linear import Linear, Shard
from kvpipe.model.quant.weights import Int4Weight, Int8Weight, QuantizedWeight


def check_quantization(quantization: str | None, cfg: ModelConfig, device: str | torch.device = "cpu") -> None:
    """Refuse a --quantization this model or device cannot run, with the reason."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if torch.device(device).type != "cpu":
        raise ConfigError(f"--quantization {quantization} runs torch's CPU int8/int4 kernels: use --device cpu")
    kind = (
        "a sparse MoE model"
        if cfg.moe is not None
        else "an MLA model"
        if cfg.mla is not None
        else "a hybrid linear-attention model"
        if cfg.hybrid is not None
        else None
    )
    if kind is not None:
        raise ConfigError(
            f"--quantization {quantization} supports dense attention models (Llama, Qwen2, Qwen3); "
            f"{cfg.architecture} is {kind}, whose experts or latent/state projections it does not quantize"
        )


def quantize_model(
    model: LMBase,
    quantization: str,
    plan: Mapping[str, tuple[str, Shard | None]],
    gguf: Mapping[str, GGUFTensor] | None = None,
    whole: Callable[[str], torch.Tensor] | None = None,
) -> dict[str, int]:
    """Quantize every packable Linear of a loaded model in place (and a tied head's copy); `plan`
    is the loader's shard plan (our param name -> (checkpoint name, this rank's Shard)), `gguf`
    the file's tensors when loading one, `whole` reads a checkpoint tensor whole (for the row
    scales of row-parallel shards). Returns how many weights became what."""
    check_quantization(quantization, model.cfg, model.embed_tokens.device)
    counts: dict[str, int] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear) or not mod.packable or mod.quant is not None:
            continue
        hf, shard = plan[f"{name}.weight"]
        src = None if gguf is None else gguf.get(hf)
        amax = None
        if shard is not None and shard.dim == 1 and whole is not None:
            amax = whole(hf).float().abs().amax(dim=1)  # [N]: TP 1's row scales
        # the logits' projection stays 8-bit in both modes, as llama.cpp keeps its output (Q6_K or
        # Q8_0) in 4-bit files
        mode = "w8a16" if mod is model.lm_head else quantization
        weight, kind = _quantized(mod.weight, mode, src, shard, amax)
        mod.quantize(weight)
        counts[kind] = counts.get(kind, 0) + 1
    if model.lm_head is None:
        model.head_quant = Int8Weight.quantize(model.embed_tokens)
        counts["int8 (tied head copy)"] = 1
    return counts


def _quantized(
    w: torch.Tensor,
    quantization: str,
    src: GGUFTensor | None,
    shard: Shard | None,
    amax: torch.Tensor | None,
) -> tuple[QuantizedWeight, str]:
    n, k = w.shape
    if quantization == "w8a16" or not Int4Weight.fits(n, k):
        return Int8Weight.quantize(w, amax), "int8"
    if src is not None and src.ggml_type in INT4_BLOCK_TYPES:
        codes = gguf_codes(src, shard)
        if codes is not None:
            return Int4Weight.from_codes(*codes), f"int4 (GGUF {src.ggml_type} blocks)"
    return Int4Weight.quantize(w), "int4"


def gguf_codes(src: GGUFTensor, shard: Shard | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """This rank's part of a Q4_0/Q4_1 tensor as (codes [N, K], scale, minimum [N, K / 32]);
    None where a column range cuts through blocks."""
    cols = src.shape[1]
    if shard is None or shard.dim == 0:
        rows = [slice(None)] if shard is None else [slice(a, a + n) for a, n in shard.ranges]
        parts = [q4_codes(src.raw_rows(r), src.ggml_type, cols) for r in rows]
        q, s, m = (torch.cat(x, dim=0) for x in zip(*parts))
        return q, s, m
    if any(a % BLOCK or n % BLOCK for a, n in shard.ranges):
        return None
    q, s, m = q4_codes(src.raw_rows(slice(None)), src.ggml_type, cols)
    return (
        torch.cat([q[:, a : a + n] for a, n in shard.ranges], dim=1),
        torch.cat([s[:, a // BLOCK : (a + n) // BLOCK] for a, n in shard.ranges], dim=1),
        torch.cat([m[:, a // BLOCK : (a + n) // BLOCK] for a, n in shard.ranges], dim=1),
    )
