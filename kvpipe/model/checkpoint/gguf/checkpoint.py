"""GGUFCheckpoint: one GGUF file opened once, seen as an HF checkpoint (config dict, tensors under
HF names, tokenizer parts). The model loader's seam:

    ckpt = GGUFCheckpoint.open(path)          # file, or a directory holding exactly one
    cfg = model_config(ckpt.config)
    t = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]   # lazy; t[a:b] dequantizes rows a:b
    parts = ckpt.tokenizer()                  # -> Tokenizer(parts.tokenizer, parts.config, ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.config import hf_config
from kvpipe.model.checkpoint.gguf.family import GGUFFamily
from kvpipe.model.checkpoint.gguf.reader import Metadata, find_gguf, open_gguf
from kvpipe.model.checkpoint.gguf.tensors import GGUFTensors, dequantize_all
from kvpipe.model.checkpoint.gguf.tokenizer import GGUFTokenizer, build_tokenizer
from kvpipe.model.registry import gguf_family, gguf_names


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path
    family: str  # GGUF general.architecture (a GGUFFamily's, model/families/)
    config: dict[str, Any]  # HF config.json equivalent (ModelConfig.from_hf_dict)
    tensors: GGUFTensors  # HF name -> lazily dequantized tensor
    metadata: Metadata

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        """Read the header, metadata and tensor table; refuse what kvpipe cannot serve (family,
        tensor types, unknown tensors, truncation) before any weight is touched."""
        file = find_gguf(path)
        if file is None:
            raise ConfigError(f"{path}: not a .gguf file or a directory holding one")
        reader: GGUFReader = open_gguf(file)
        meta = Metadata(file, reader)
        family, header = _family(meta)
        names = frozenset(t.name for t in reader.tensors)
        config = hf_config(meta, names, family.architecture, header, family.config_keys)
        try:
            tensors = GGUFTensors(reader, family, config)
        except ConfigError as e:
            raise ConfigError(f"{file}: {e}") from None
        return cls(file, family.architecture, config, tensors, meta)

    def state_dict(self, dtype: torch.dtype = torch.float32, progress: bool | None = None) -> dict[str, torch.Tensor]:
        """Every tensor dequantized once into `dtype`, under HF names (no lm_head when tied)."""
        return dequantize_all(self.tensors, dtype, progress)

    def tokenizer(self) -> GGUFTokenizer:
        return self._tokenizer

    @cached_property
    def _tokenizer(self) -> GGUFTokenizer:
        return build_tokenizer(self.metadata, self.tensors.family.token_order_merges)


def _family(meta: Metadata) -> tuple[GGUFFamily, dict[str, Any]]:
    """The GGUF names and the HF header of the family the file's general.architecture names,
    refused by name unless a family reads it."""
    arch = meta.require("general.architecture")
    family = gguf_family(arch)
    if family is None or family.gguf is None:
        raise ConfigError(
            f"{meta.path}: GGUF architecture {arch!r} is not supported; kvpipe reads GGUF files of {gguf_names()}"
        )
    return family.gguf, family.hf_header()


def gguf_checkpoint(path: str | Path) -> GGUFCheckpoint | None:
    """The GGUF checkpoint `path` names (a .gguf file, or a directory holding one and no
    config.json), None for anything else (an HF directory). Opened once per process: parsing the
    metadata of a 49k-token vocabulary takes seconds, and a server reads the config, the tokenizer
    and the weights of the same file from different places."""
    file = find_gguf(path)
    if file is None:
        return None
    st = file.stat()
    return _open_once(file.resolve(), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=2)
def _open_once(file: Path, mtime_ns: int, size: int) -> GGUFCheckpoint:
    """Keyed by mtime and size too, so a file rewritten in place is read again (a ConfigError is
    not cached: a fixed file is retried)."""
    return GGUFCheckpoint.open(file)
