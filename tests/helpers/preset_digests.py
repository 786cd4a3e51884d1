"""A preset checkpoint's files by content: byte-identical writes have equal digests."""

from __future__ import annotations

import hashlib
from pathlib import Path

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def digests(path: Path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}
