"""transformers' float32 model from a GGUF file, the tests' reference, with the file's metadata
parsed once instead of twice and on a plain array; its tokenizer likewise.

transformers (its legacy GGUF path, which Gemma 3, Qwen2 and Llama files take) builds a
`gguf.GGUFReader` of the whole file for the config and a second one for the weights, and the
reader slices its np.memmap a few times per vocabulary string: a np.memmap slice runs
memmap.__array_finalize__ each time: most of the 83 s Gemma-3-270M's model (262,144 pieces, 6 s
of dequantizing) and the 65 s Qwen2.5-Coder-0.5B's took to load on a 2-core host, 40 and 27 s
this way (its tokenizer 35 -> 26 and 27 -> 11 s; 2026-12-02). Here, for the length of
one load, `gguf.GGUFReader` (which transformers imports from gguf at each load) is a subclass that
parses on a plain ndarray view of the same mapped bytes (kvpipe's own reader's base,
kvpipe/model/checkpoint/gguf/reader.PlainArrayReader) and is built once per path. The bytes read, the parse and
every step transformers takes after it are unchanged: the model is the one
`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` returns. AutoTokenizer reads the
config the same way (one reader) before it builds the tokenizer from its own, faster reader."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import gguf

from kvpipe.model.checkpoint.gguf.reader import PlainArrayReader


@contextmanager
def one_parse_per_file() -> Iterator[None]:
    """While open, transformers' GGUF loads build one plain-array reader per file."""
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def reader(p: Any, mode: Literal["r", "r+", "c"] = "r") -> gguf.GGUFReader:
        key = (str(p), mode)
        if key not in readers:
            readers[key] = PlainArrayReader(p, mode)
        return readers[key]

    stock = gguf.GGUFReader
    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = stock  # type: ignore[misc]


def hf_causal_lm(path: Path) -> Any:
    """transformers' model from the GGUF at `path`, float32, in eval mode (a new one each call)."""
    import torch
    from transformers import AutoModelForCausalLM

    with one_parse_per_file():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def hf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer from the GGUF at `path` (its config is read from the file first)."""
    from transformers import AutoTokenizer

    with one_parse_per_file():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
