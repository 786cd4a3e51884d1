"""GGUF's 4-bit blocks read as integer codes and per-block scale and minimum, without
dequantizing: what --quantization w4a16 loads straight into its int4 kernel (quantized_weight.py).

A block holds 32 consecutive weights of one row (ggml-common.h):
- Q4_0 (18 bytes): d fp16, 16 bytes of nibbles; w = d * (q - 8);
- Q4_1 (20 bytes): d fp16, m fp16, 16 bytes of nibbles; w = d * q + m.
Byte j holds weight j in its low nibble and weight j + 16 in its high one.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32  # weights per Q4_0 / Q4_1 block
_BYTES = {"Q4_0": 18, "Q4_1": 20}
INT4_BLOCK_TYPES = tuple(_BYTES)


def q4_codes(raw: np.ndarray, ggml_type: str, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw uint8 [rows, cols / 32 * block bytes] of a Q4_0/Q4_1 tensor -> codes uint8 [rows, cols]
    in 0..15, scale and minimum float32 [rows, cols / 32], with w = codes * scale + minimum."""
    if ggml_type not in _BYTES:
        raise ValueError(f"{ggml_type} is not a 4-bit block type ({', '.join(_BYTES)})")
    if cols % BLOCK:
        raise ValueError(f"{cols} columns are not whole blocks of {BLOCK}")
    rows, nb = raw.shape[0], cols // BLOCK
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, _BYTES[ggml_type])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    if ggml_type == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:20]
    else:
        m = -8.0 * d
        nibbles = blocks[..., 2:18]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)  # [rows, nb * 32]
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)
