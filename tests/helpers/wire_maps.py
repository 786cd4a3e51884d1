"""Wire maps (a decoded message or JSON body) as the fuzz tests take them apart."""

from __future__ import annotations

from typing import Any


def key_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Key paths into a wire map, nested maps included (a layout's fields, aux data)."""
    out = []
    for k, v in obj.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out.extend(key_paths(v, prefix + (k,)))
    return out
