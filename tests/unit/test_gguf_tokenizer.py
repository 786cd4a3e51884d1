"""The tokenizer of a small written GGUF: special and user-defined tokens whole, merges, BOS as
add_bos_token says, llama.cpp's pre-tokenizer split per `tokenizer.ggml.pre` (the same ids as
transformers where transformers follows llama.cpp), and kvpipe's Tokenizer built from the parts."""

from __future__ import annotations

import pytest

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.checkpoint import GGUFCheckpoint
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.gguf_files import USER_TOKEN, vocab, write_gguf

TOKENS = vocab()[0]


def ids_of(*pieces: str) -> list[int]:
    return [TOKENS.index(p) for p in pieces]


def parts(tmp_path, **meta):
    return GGUFCheckpoint.open(write_gguf(tmp_path / "m.gguf", "llama", meta=meta).path).tokenizer()


def test_special_tokens_merges_and_decode(tmp_path):
    p = parts(tmp_path)
    enc = p.tokenizer.encode("<|im_start|> the and<think>x<|im_end|>").ids
    assert enc == [1, *ids_of("Ġthe", "Ġand"), TOKENS.index(USER_TOKEN), TOKENS.index("x"), 2]
    assert p.tokenizer.decode(enc, skip_special_tokens=True) == f" the and{USER_TOKEN}x"
    assert p.tokenizer.decode(enc, skip_special_tokens=False) == f"<|im_start|> the and{USER_TOKEN}x<|im_end|>"
    assert p.config["bos_token"] == "<|im_start|>" and p.config["eos_token"] == "<|im_end|>"
    assert p.config["pad_token"] == "<|endoftext|>" and p.eos_token_ids == (2,)
    assert p.tokenizer.get_vocab_size() == len(TOKENS)  # the added tokens are the vocabulary's own


def test_kvpipe_tokenizer_from_parts(tmp_path):
    p = parts(tmp_path, **{"tokenizer.ggml.add_bos_token": True})
    tok = Tokenizer(p.tokenizer, p.config, p.chat_template, p.eos_token_ids)
    assert tok.encode(" the") == [1, TOKENS.index("Ġthe")]  # BOS once: the post-processor adds it
    assert tok.encode(" the", add_special_tokens=False) == [TOKENS.index("Ġthe")]
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[:2] == [1, *ids_of("u")]


@pytest.mark.parametrize(
    "pre, want",
    [
        ("llama-bpe", ["123", "45"]),  # \p{N}{1,3}
        ("gpt2", ["123", "45"]),  # " ?\p{N}+" then the merges
        ("qwen2", ["1", "2", "3", "4", "5"]),  # \p{N}: one digit per piece
        ("smollm", ["1", "2", "3", "4", "5"]),  # llama.cpp splits digits first
    ],
)
def test_pre_tokenizer_digits(tmp_path, pre, want):
    assert parts(tmp_path, **{"tokenizer.ggml.pre": pre}).tokenizer.encode("12345").ids == ids_of(*want)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_ids_equal_transformers(tmp_path, pre):
    """transformers' GGUF tokenizer uses the same splits for these (for "smollm" it keeps GPT-2's
    regex and digit runs merge, unlike llama.cpp; SmolLM2's own vocabulary has no digit merges)."""
    from transformers import AutoTokenizer

    w = write_gguf(tmp_path / "m.gguf", "qwen2" if pre == "qwen2" else "llama", meta={"tokenizer.ggml.pre": pre})
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    ours = GGUFCheckpoint.open(w.path).tokenizer().tokenizer
    for text in ["12345 and 678", "the them then\n\n  x", "it's <|im_start|>héllo 🎉 日本<think>", "  \t end "]:
        assert ours.encode(text).ids == hf(text)["input_ids"], text


def test_refused_tokenizers(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer model 'llama' is not supported"):
        parts(tmp_path, **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(ConfigError, match="pre-tokenizer 'made-up' is not supported"):
        parts(tmp_path, **{"tokenizer.ggml.pre": "made-up"})
    with pytest.raises(ConfigError, match="eos_token_id 9999 is outside the vocabulary"):
        parts(tmp_path, **{"tokenizer.ggml.eos_token_id": 9999})
