"""Tokenizer: round trips, special tokens, chat templates (HF parity), incremental detokenizing."""

from __future__ import annotations

import json
import shutil

import jinja2
import pytest

from kvpipe.config import ConfigError
from kvpipe.model.text.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["the cat and the dog", "héllo wörld", "日本語のテキスト", "emoji 🎉🦀 mixed", "  spaces\n\ttabs  ", ""]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id  # the post-processor adds BOS
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_merges_shorten_english(tok):
    assert len(tok.encode(" the", add_special_tokens=False)) == 1
    assert len(tok.encode("the cat and the dog", add_special_tokens=False)) < len("the cat and the dog")


def test_special_tokens(tok):
    assert tok.eos_token_ids == (tok.token_to_id("<|eos|>"),)
    ids = tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "user"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user<|im_end|>"
    assert tok.vocab_size == 1 + max(tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|im_end|>"))


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == (
        "<|bos|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == text[: -len("<|im_start|>assistant\n")]
    parts = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
    ]
    assert tok.apply_chat_template(parts) == text
    ids = tok.encode_chat(msgs)
    assert ids.count(tok.bos_token_id) == 1 and tok.decode(ids, skip_special_tokens=False) == text
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_template_matches_transformers(tiny_model_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [
        {"role": "user", "content": "héllo 🎉"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "and?"},
    ]
    for gen in (True, False):
        want = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert hf.encode(TEXTS[1]) == tok.encode(TEXTS[1])


def _dir_with_template(tiny_model_dir, tmp_path, template):
    d = shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_template_is_sandboxed(tiny_model_dir, tmp_path):
    d = _dir_with_template(tiny_model_dir, tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_helpers_and_named_templates(tiny_model_dir, tmp_path):
    tmpl = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{{ m | tojson }}{% endfor %}"
    )
    d = _dir_with_template(
        tiny_model_dir, tmp_path, [{"name": "tool_use", "template": "x"}, {"name": "default", "template": tmpl}]
    )
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template([{"role": "user", "content": "é<"}]) == '{"role": "user", "content": "é<"}'
    with pytest.raises(jinja2.exceptions.TemplateError, match="no tools"):
        t.apply_chat_template([{"role": "tool", "content": ""}])


def test_chat_template_jinja_file_and_missing(tiny_model_dir, tmp_path):
    d = _dir_with_template(tiny_model_dir, tmp_path, None)
    with pytest.raises(ConfigError, match="no chat_template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", ["héllo wörld", "日本語 and 🎉🦀!", "plain ascii text"])
def test_incremental_detokenizer_holds_back_split_characters(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte tokens
    det = IncrementalDetokenizer(tok)
    chunks = [det.add([i]) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + det.flush() == text
    if any(ord(c) > 127 for c in text):
        assert "" in chunks  # some token completed no character and was held back


def test_incremental_detokenizer_flushes_incomplete_tail(tok):
    ids = tok.encode("a🎉", add_special_tokens=False)[:-1]  # cut inside the emoji's 4 bytes
    det = IncrementalDetokenizer(tok)
    assert det.add(ids[:1]) == "a"
    assert det.add(ids[1:]) == ""
    tail = det.flush()
    assert tail and set(tail) == {"\ufffd"}
    assert det.add(tok.encode("b", add_special_tokens=False)) == "b"


def test_incremental_detokenizer_skips_special_tokens(tok):
    det = IncrementalDetokenizer(tok)
    out = det.add(tok.encode("hi", add_special_tokens=False))
    out += det.add([tok.token_to_id("<|im_end|>")]) + det.add(tok.encode(" yo", add_special_tokens=False))
    assert out + det.flush() == "hi yo"
