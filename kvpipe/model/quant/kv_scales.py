"""Per-layer fp8 KV-cache scales from a checkpoint, as SGLang and vLLM read them.

An fp8-KV checkpoint (ModelOpt, compressed-tensors, Quark, AutoFP8) stores one scalar per
attention layer for K and one for V: stored = value / scale. The names differ by tool:
`self_attn.k_scale` (and `.attn.k_scale`, `.k_proj.k_scale`, compressed-tensors'
`.k_proj.output_scale`), or one `self_attn.kv_scale` for both (older AutoFP8). SGLang remaps them
all onto `attn.k_scale` / `attn.v_scale` and uses 1.0 where a checkpoint has none; so do we. An
MLA latent has one scale (`k_scale`) for its keys and values alike. GGUF files have none.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVScales:
    """Scales of the KV pool's layers (ModelConfig.kv_layers order), 1.0 where none was found."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    found: int = 0  # layers whose scales came from the checkpoint

    @classmethod
    def ones(cls, num_kv_layers: int) -> KVScales:
        return cls((1.0,) * num_kv_layers, (1.0,) * num_kv_layers)


def scale_names(attn: str, kind: str) -> tuple[str, ...]:
    """Checkpoint names one layer's `kind` ("k" | "v") scale may have, `attn` its attention
    module's name (e.g. "model.layers.3.self_attn"), most specific first."""
    return (
        f"{attn}.{kind}_scale",
        f"{attn}.attn.{kind}_scale",
        f"{attn}.{kind}_proj.{kind}_scale",
        f"{attn}.{kind}_proj.output_scale",
        f"{attn}.kv_scale",
    )


def read_kv_scales(attn_names: list[str], names: Collection[str], read: Callable[[str], Any]) -> KVScales:
    """attn_names: each KV layer's attention module as the checkpoint names it; names: the
    checkpoint's tensor names; read(name) -> a scalar tensor (or anything float() takes)."""

    def one(attn: str, kind: str) -> float | None:
        name = next((n for n in scale_names(attn, kind) if n in names), None)
        if name is None:
            return None
        t = read(name)
        value = float(t.reshape(-1)[0]) if hasattr(t, "reshape") else float(t)
        if not value > 0 or value == float("inf"):
            raise ValueError(f"KV scale {name} must be a positive finite number, got {value}")
        return value

    ks, vs, found = [], [], 0
    for attn in attn_names:
        k, v = one(attn, "k"), one(attn, "v")
        found += k is not None or v is not None
        ks.append(1.0 if k is None else k)
        vs.append(1.0 if v is None else v)
    return KVScales(tuple(ks), tuple(vs), found)
