"""The trained GGUFs kvpipe serves (tests/helpers/trained_models.py: SmolLM2-135M-Instruct, the
default, and Qwen2.5-Coder-0.5B-Instruct in `make test`; Qwen2.5-Coder-1.5B-Instruct `slow`)
against transformers loading the same file: config, every tensor bit for bit (both dequantize with
gguf-py, K-quants included), token ids, decoding, special tokens, the chat template; the two Qwens
share one tokenizer (the 0.5B drafts for the 1.5B); and truncated copies refused cleanly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.checkpoint import GGUFCheckpoint
from kvpipe.model.registry import model_config
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers import trained_models as trained

# a liveness deadline, setup included: loading a Qwen (transformers dequantizes the whole file, kvpipe
# packs it) took 2-8 minutes on a loaded 2-core host
pytestmark = pytest.mark.timeout(1800)

TEXTS = [
    "The capital of France is Paris.",
    "",
    " leading space, trailing space ",
    "It's what they'd've wanted, ISN'T it? I'll see; you're right.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tif x >= 10_000: pass\r\n",
    "Numbers: 3.14159, 2024-06-01, 1,234,567 and 0x1F.",
    "emoji 🎉🦀👩‍👩‍👧 and flags 🇫🇷",
    "日本語のテキストと中文文本，한국어 텍스트",
    "héllo wörld — naïve café, Ελληνικά, русский, e\u0301 (decomposed)",
    "   many     spaces\n\n\n\nand newlines   ",
    "whitespace before digits:\n\n\n0, \t 42,   7",  # SmolLM2 splits digits first (tokenizer.ggml.pre 'smollm')
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Translate 'cat' to 日本語."},
    ],
    [{"role": "user", "content": "Fix the bug:\n```python\ndef add(a, b):\n    return a - b\n```"}],
]


@pytest.fixture(scope="module", params=trained.params())
def model(request: pytest.FixtureRequest) -> trained.TrainedModel:
    return trained.MODELS[request.param]


@pytest.fixture(scope="module")
def ckpt(model: trained.TrainedModel) -> GGUFCheckpoint:
    return GGUFCheckpoint.open(model.path())


@pytest.fixture(scope="module")
def hf_model(model: trained.TrainedModel):
    return trained.hf_model(model.name)


@pytest.fixture(scope="module")
def hf_tok(model: trained.TrainedModel):
    return trained.hf_tokenizer(model.name)


@pytest.fixture(scope="module")
def tok(model: trained.TrainedModel) -> Tokenizer:
    return trained.kvpipe_tokenizer(model.name)


def test_directory_finds_the_file(ckpt: GGUFCheckpoint, tmp_path: Path) -> None:
    (tmp_path / ckpt.path.name).symlink_to(ckpt.path)
    assert GGUFCheckpoint.open(tmp_path).path.resolve() == ckpt.path.resolve()


def test_config_matches_hf(model: trained.TrainedModel, ckpt: GGUFCheckpoint, hf_model) -> None:
    hf = hf_model.config
    cfg = ckpt.config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert cfg[key] == getattr(hf, key), key
    attn = hf_model.model.layers[0].self_attn
    assert cfg["head_dim"] == attn.head_dim
    assert cfg["attention_bias"] == (attn.q_proj.bias is not None) == (attn.k_proj.bias is not None)
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] and "rope_scaling" not in cfg
    m = model_config(cfg)
    got = (m.architecture, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim)
    assert got == (model.architecture, model.layers, model.hidden, model.heads, model.kv_heads, model.head_dim)
    assert (m.tie_word_embeddings, m.attention_bias, m.vocab_size) == (model.tied, model.qkv_bias, model.vocab)
    assert m.eos_token_ids == model.eos_ids and m.dtype == "float32"


def test_every_tensor_equals_hf(model: trained.TrainedModel, ckpt: GGUFCheckpoint, hf_model) -> None:
    """One tensor at a time (the 1.5B's whole state dict is 6 GB in float32)."""
    theirs = hf_model.state_dict()
    ours = set(ckpt.tensors)
    assert set(theirs) - ours == ({"lm_head.weight"} if model.tied else set())
    assert ours <= set(theirs)
    for name in ckpt.tensors:
        t = ckpt.tensors[name].load(torch.float32)
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    if model.tied:
        assert torch.equal(theirs["lm_head.weight"], theirs["model.embed_tokens.weight"])
    assert {ckpt.tensors[n].ggml_type for n in ours} == model.tensor_types


def test_head_slices_equal_the_whole(model: trained.TrainedModel, ckpt: GGUFCheckpoint) -> None:
    """What a TP rank reads: heads 3..5 of q (rows permuted in the file for llama), kv head 1 of k
    (K-quant blocks run along a row, so a row range dequantizes alone), and their biases."""
    d = model.head_dim
    names = [f"model.layers.7.self_attn.{x}_proj.weight" for x in "qk"]
    if model.qkv_bias:
        names += [f"model.layers.7.self_attn.{x}_proj.bias" for x in "qk"]
    for name in names:
        t = ckpt.tensors[name]
        rows = slice(3 * d, 6 * d) if ".q_proj." in name else slice(d, 2 * d)
        assert torch.equal(t[rows], t.load()[rows]), name


def test_special_tokens_match_hf(model: trained.TrainedModel, tok: Tokenizer, hf_tok) -> None:
    for name in ("bos_token", "eos_token", "pad_token"):
        assert getattr(tok, name) == getattr(hf_tok, name), name
    assert tok.bos_token_id == hf_tok.bos_token_id == model.bos_id
    assert tok.eos_token_ids == (hf_tok.eos_token_id,) == model.eos_ids
    assert tok.vocab_size == len(hf_tok) == model.vocab


@pytest.mark.parametrize("i", range(len(TEXTS) + 1))
def test_token_ids_and_decoding_match_hf(model: trained.TrainedModel, tok: Tokenizer, hf_tok, i: int) -> None:
    text = TEXTS[i] if i < len(TEXTS) else model.special_text
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text == hf_tok.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_hf(tok: Tokenizer, hf_tok, chat: list[dict[str, str]], gen: bool) -> None:
    text = tok.apply_chat_template(chat, add_generation_prompt=gen)
    assert text == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    want = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
    assert tok.encode_chat(chat, add_generation_prompt=gen) == list(want)


@pytest.mark.slow
def test_qwen_pair_shares_one_tokenizer() -> None:
    """The 0.5B is a real draft for the 1.5B (speculative decoding proposes the target's token ids):
    the same vocabulary, token types, merges, special ids and chat template."""
    small, large = (GGUFCheckpoint.open(trained.gguf_path(n)).metadata for n in (trained.QWEN_05B, trained.QWEN_15B))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        assert np.array_equal(np.asarray(small.get(key)), np.asarray(large.get(key))), key
    for key in ("pre", "bos_token_id", "eos_token_id", "padding_token_id"):
        assert small.get(f"tokenizer.ggml.{key}") == large.get(f"tokenizer.ggml.{key}"), key
    assert small.get("tokenizer.chat_template") == large.get("tokenizer.chat_template")


@pytest.mark.parametrize("fraction", [0.0001, 0.005, 0.5, -1])
def test_truncated_copy_refused(tmp_path: Path, fraction: float) -> None:
    """Cut in the metadata, in the vocabulary, in the tensor data, and one byte short (the default
    model: the reader's checks do not depend on the family)."""
    path = trained.gguf_path(trained.SMOLLM2)
    size = path.stat().st_size
    keep = size - 1 if fraction == -1 else int(size * fraction)
    cut = tmp_path / path.name
    with open(path, "rb") as src:
        cut.write_bytes(src.read(keep))
    with pytest.raises(ConfigError, match="not a readable GGUF file, truncated or corrupt"):
        GGUFCheckpoint.open(tmp_path)
