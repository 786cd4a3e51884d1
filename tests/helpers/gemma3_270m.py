"""Gemma-3-270M (base, trained) for the tests: the catalog's Q4_K_M GGUF (fetched once, file-locked:
kvpipe/model/checkpoint/fetch.py), kvpipe's tokenizer and transformers' float32 model and tokenizer
from the same file (the reference), and plain-text prompts (a base model: no chat template), one of
them past 2,048 tokens so the sliding layers' window of 512 slides four times. Each is built once
per test process (loading dequantizes the whole file; transformers rebuilds the 262,144-token
vocabulary's merges in Python): the modules that use them share them."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from kvpipe.model.checkpoint.catalog import CATALOG
from kvpipe.model.checkpoint.fetch import fetch
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers import hf_gguf

NAME = "gemma-3-270m"
LONG_TOKENS = 2100  # > 4 windows of 512

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Water boils at 100 degrees Celsius, and it freezes at",
    "In 1969, the first humans to walk on the Moon were",
    "La capitale de l'Italie est",
    "Photosynthesis is the process by which plants",
]


@lru_cache(maxsize=1)
def path() -> Path:
    return fetch(CATALOG[NAME])


@lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(path())


def long_prompt() -> list[int]:
    """LONG_TOKENS tokens of English prose and code: this repository's docs (BOS first): the security
    model's prose (docs/security.md) and the architecture, not the README, which keeps changing."""
    root = Path(__file__).resolve().parents[2]
    text = "\n\n".join((root / f).read_text() for f in ("docs/security.md", "docs/architecture.md"))
    ids = tokenizer().encode(text)
    assert len(ids) >= LONG_TOKENS, len(ids)
    return ids[:LONG_TOKENS]


@lru_cache(maxsize=1)
def hf_model() -> Any:
    """transformers' Gemma3ForCausalLM from the GGUF, float32, in eval mode (shared: do not modify)."""
    return hf_gguf.hf_causal_lm(path())


@lru_cache(maxsize=1)
def hf_tokenizer() -> Any:
    return hf_gguf.hf_tokenizer(path())
