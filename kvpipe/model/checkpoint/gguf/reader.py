"""Open a GGUF file with `gguf.GGUFReader` and turn what can go wrong into one clear ConfigError:
a path that holds no (or several) GGUF files, a truncated or corrupt file, a split file, a tensor
type kvpipe does not dequantize."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderField

from kvpipe.config import ConfigError

GGUF_SUFFIX = ".gguf"

# Tensor types kvpipe dequantizes (with gguf.quants.dequantize), each covered by a round-trip test:
# the float types and the block quantizations llama.cpp's common presets (Q4_0 ... Q8_0, Q2_K ... Q6_K)
# produce. Others (the i-quants, ternary and fp4 types, integer tensors) are refused by name.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    GGMLQuantizationType[n]
    for n in (
        "F32",
        "F16",
        "BF16",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    )
)
_KNOWN_TYPE_IDS = frozenset(int(t) for t in GGMLQuantizationType)

# What GGUFReader raises on a file that ends early or holds garbage: numpy reshapes/views of a
# short memmap (ValueError), reads past the end (IndexError), undecodable names, huge counts.
_CORRUPT = (ValueError, IndexError, KeyError, OverflowError, TypeError, MemoryError)


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` in a directory that has no
    config.json (a directory with one is an HF checkpoint). None when `path` is not a GGUF checkpoint."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ConfigError(f"{path}: holds {len(found)} GGUF files ({names}); pass --model-path the one to serve")
    return found[0] if found else None


class PlainArrayReader(GGUFReader):
    """GGUFReader that parses on a plain ndarray view of the file's memmap (the same mapped bytes):
    the reader slices the buffer a few times per vocabulary string, and a np.memmap slice runs
    memmap.__array_finalize__ each time, over half of the metadata parse of a 49k-token vocabulary.
    (tests/helpers/hf_gguf.py hands it to transformers' GGUF loads too.)"""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)  # a view: keeps the memmap (and its mapping) alive


class _CheckedReader(PlainArrayReader):
    """PlainArrayReader that names the tensor of an unknown type id. The stock reader turns the id
    into GGMLQuantizationType first and fails with "99 is not a valid GGMLQuantizationType", without
    saying which tensor; the tensor-info fields it parsed just before carry the name."""

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        for field in fields:
            name_data, raw_dtype = field.parts[1], field.parts[4]
            if int(raw_dtype[0]) not in _KNOWN_TYPE_IDS:
                name = bytes(name_data).decode("utf-8", errors="replace")
                raise ConfigError(f"tensor {name!r} has unknown GGML type id {int(raw_dtype[0])}")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> GGUFReader:
    """Parse the header, metadata and tensor table (tensor data stays memory-mapped)."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such GGUF file")
    try:
        reader = _CheckedReader(path)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except _CORRUPT as e:
        size = path.stat().st_size
        raise ConfigError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({size} bytes; gguf reader: {e})"
        ) from None
    check_tensor_types(path, reader)
    split = field_value(reader.fields.get("split.count"))
    if split is not None and int(split) > 1:
        raise ConfigError(f"{path}: is one part of a {split}-way split GGUF; merge the parts first (llama-gguf-split)")
    return reader


def check_tensor_types(path: Path, reader: GGUFReader) -> None:
    bad = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type not in SUPPORTED_TYPES]
    if bad:
        shown = ", ".join(f"{name} ({kind})" for name, kind in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ConfigError(f"{path}: unsupported tensor types: {shown}{more}; kvpipe dequantizes {supported}")


def field_value(field: ReaderField | None) -> Any:
    """A metadata value as Python: str, int, float, bool, or a list of them; None when absent."""
    if field is None:
        return None
    try:
        value = field.contents()
    except (UnicodeDecodeError, IndexError, ValueError) as e:
        raise ConfigError(f"GGUF metadata {field.name!r} is unreadable: {e}") from None
    return value.item() if isinstance(value, np.generic) else value


class Metadata:
    """The key/value metadata of an open file, decoded on demand (the vocabulary is 100k strings)."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self._fields = reader.fields

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        value = field_value(self._fields.get(key))
        return default if value is None else value

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ConfigError(f"{self.path}: GGUF metadata lacks {key!r}")
        return self.get(key)

    def require_int(self, key: str) -> int:
        value = self.require(key)
        if isinstance(value, bool) or not isinstance(value, int):
            # e.g. a per-layer list of head counts (models with layers of different widths)
            raise ConfigError(f"{self.path}: GGUF metadata {key}={_short(value)} is not one integer")
        return value

    def int_or(self, key: str, default: int) -> int:
        """An integer key, `default` when the file lacks it."""
        return self.require_int(key) if key in self else default

    def require_float(self, key: str) -> float:
        value = self.require(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{self.path}: GGUF metadata {key}={_short(value)} is not a number")
        return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
