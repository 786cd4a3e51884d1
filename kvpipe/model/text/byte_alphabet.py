"""GPT-2's byte-level alphabet: the byte -> printable character table that byte-level BPE
vocabularies (GPT-2, Llama 3, Qwen2/3, SmolLM, the presets' tokenizer) are spelled in. Its own
module so the tokenizer, the GGUF tokenizer builder and the presets share one table without
importing each other."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Printable Latin-1 bytes map to themselves, the rest to U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}
