"""GGUF tensors under their HF names, dequantized on access with `gguf.quants.dequantize`.

A GGUFTensor reads like a safetensors slice (`get_shape()`, `t[:]`, `t[a:b]`, `t[:, a:b]`), so a
TP rank asks for its rows only: block quantization runs along each row, so rows dequantize
independently and a rank never dequantizes another rank's rows. The result is float32 (what
gguf's dequantizers produce); `load(dtype)` casts the whole tensor.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.family import GLOBAL_TENSORS, GGUFFamily

# Tensors refused with a reason, rather than as merely unknown
_REFUSED = {
    "rope_freqs.weight": "per-dimension RoPE frequency factors (Llama 3.1-style rope scaling) are not supported",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str, family: GGUFFamily, num_layers: int) -> str | None:
    """llama.cpp's tensor name -> HF's, None for a name this family does not have."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m is None or int(m[1]) >= num_layers or m[2] not in family.layer_tensors:
        return None
    return f"model.layers.{int(m[1])}.{family.layer_tensors[m[2]]}"


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reorders each head's q/k rows from HF's rotate-half layout
    (first half, second half) into interleaved pairs (GGUFFamily.permuted_qk). Gather order undoing it (as
    transformers' reverse_permute): HF row i is GGUF row order[i]."""
    if rows % (2 * n_head):
        raise ConfigError(f"{rows} q/k rows do not split into {n_head} heads of rotary pairs")
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor of the file, under its HF name and in HF's [out, in] layout."""

    name: str
    raw: ReaderTensor
    row_order: np.ndarray | None = None  # HF row i = file row row_order[i]; None: the file's order
    shift: float = 0.0  # subtracted from every value read (GGUFFamily.norm_shift, on its norms)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.raw.shape))  # GGUF lists dims fastest first

    @property
    def ggml_type(self) -> str:
        return self.raw.tensor_type.name

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def load(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole tensor, dequantized, in `dtype`."""
        data = self.raw.data if self.row_order is None else self.raw.data[self.row_order]
        return self._to_torch(data).to(dtype)

    def __getitem__(self, key: Any) -> torch.Tensor:
        """float32 like a safetensors slice; a row range dequantizes those rows only."""
        key = key if isinstance(key, tuple) else (key,)
        if len(self.shape) != 2 or not key or not isinstance(key[0], slice):
            return self.load()[key]
        rows = np.arange(self.shape[0])[key[0]]
        data = self.raw.data[rows if self.row_order is None else self.row_order[rows]]
        return self._to_torch(data)[(slice(None),) + key[1:]]

    def raw_rows(self, key: slice) -> np.ndarray:
        """The file's bytes of HF rows `key`, in HF order: [rows, bytes per row] (blocks.py reads
        4-bit blocks from them without dequantizing)."""
        if self.shift:
            raise ValueError(f"{self.name}: its stored values are shifted; read it dequantized")
        rows = np.arange(self.shape[0])[key]
        return self.raw.data[rows if self.row_order is None else self.row_order[rows]]

    def _to_torch(self, data: np.ndarray) -> torch.Tensor:
        arr = dequantize(data, self.raw.tensor_type)
        if self.shift:  # in the file's float32, as transformers does (a new array)
            arr = arr - np.float32(self.shift)
        if not arr.flags.writeable or not arr.flags.c_contiguous:  # F32 comes back as a view of the file
            arr = np.array(arr, order="C")
        if len(self.shape) == 2:
            arr = arr.reshape(-1, self.shape[1])
        return torch.from_numpy(arr)


class GGUFTensors(Mapping[str, GGUFTensor]):
    """HF name -> GGUFTensor for every tensor of the file. Refuses a file with a tensor this
    family does not have (it would be dropped silently, and the model computed without it)."""

    def __init__(self, reader: GGUFReader, family: GGUFFamily, config: dict[str, Any]) -> None:
        layers = int(config["num_hidden_layers"])
        self.family = family
        self._tensors: dict[str, GGUFTensor] = {}
        unknown = []
        for t in reader.tensors:
            if t.name in _REFUSED:
                raise ConfigError(f"tensor {t.name}: {_REFUSED[t.name]}")
            name = hf_tensor_name(t.name, family, layers)
            if name is None:
                unknown.append(t.name)
                continue
            shift = family.norm_shift if name.endswith("norm.weight") else 0.0
            self._tensors[name] = GGUFTensor(name, t, self._row_order(t, family, config), shift)
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ConfigError(f"tensors a {family.architecture} model does not have: {', '.join(unknown[:5])}{more}")

    @staticmethod
    def _row_order(t: ReaderTensor, family: GGUFFamily, config: dict[str, Any]) -> np.ndarray | None:
        if not family.permuted_qk:
            return None
        m = _LAYER.fullmatch(t.name)
        part = m[2] if m else ""
        rows = int(t.shape[-1])  # the out dim: for a bias, its only dim
        if part in ("attn_q.weight", "attn_q.bias"):
            return unpermute_rows(rows, int(config["num_attention_heads"]))
        if part in ("attn_k.weight", "attn_k.bias"):
            return unpermute_rows(rows, int(config["num_key_value_heads"]))
        return None

    def __getitem__(self, name: str) -> GGUFTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def show_progress(progress: bool | None) -> bool:
    """None: a bar when stderr is a terminal (not in logs, tests or pipes)."""
    return sys.stderr.isatty() if progress is None else progress


def progress_bar(total: int, progress: bool | None = None, desc: str = "dequantizing GGUF") -> tqdm:
    return tqdm(
        total=total, desc=desc, unit="tensor", disable=not show_progress(progress), file=sys.stderr, leave=False
    )


def dequantize_all(
    tensors: Mapping[str, GGUFTensor], dtype: torch.dtype = torch.float32, progress: bool | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized once into `dtype` (an HF-style state dict)."""
    out = {}
    with progress_bar(len(tensors), progress) as bar:
        for name, t in tensors.items():
            out[name] = t.load(dtype)
            bar.update()
    return out
