"""Tokenizer of a model directory: tokenizer.json via the `tokenizers` library, special tokens and
chat template from tokenizer_config.json (or chat_template.jinja, as transformers >= 4.5x saves it);
or of a GGUF file (model/checkpoint/gguf/tokenizer.py builds the same parts from its metadata).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.checkpoint import gguf_checkpoint
from kvpipe.model.text.byte_alphabet import unicode_to_bytes
from kvpipe.model.text.chat_template import render_chat

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def _token_text(tok: Any) -> str | None:
    """tokenizer_config tokens are strings or AddedToken dicts {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    def __init__(
        self,
        tok: _HFTokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        extra_eos_ids: tuple[int, ...] = (),
    ) -> None:
        self._tok = tok
        config = config or {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.chat_template = chat_template
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        eos = [self.token_to_id(self.eos_token)] if self.eos_token else []
        ids = [i for i in (*eos, *extra_eos_ids) if i is not None]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        # Older Llama tokenizers ask for BOS in tokenizer_config instead of the post-processor.
        self._force_bos = bool(config.get("add_bos_token")) and self.bos_token_id is not None

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: tuple[int, ...] = ()) -> Tokenizer:
        """An HF directory's tokenizer files, or a GGUF file's `tokenizer.ggml.*` and chat template
        (a .gguf file, or a directory holding one)."""
        ckpt = gguf_checkpoint(path)
        if ckpt is not None:
            parts = ckpt.tokenizer()
            return cls(parts.tokenizer, parts.config, parts.chat_template, (*parts.eos_token_ids, *extra_eos_ids))
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ConfigError(f"{path}: no tokenizer.json (kvpipe needs a fast tokenizer file)")
        tok = _HFTokenizer.from_file(str(tj))
        cfg_path = path / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = path / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        return cls(tok, config, template, extra_eos_ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch of one: the same ids, but it releases the GIL while it works (encode holds
        # it: 4.5 s for a 1.2M-character prompt during which the server's event loop stood still)
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id  # never None where _force_bos is set
        if add_special_tokens and self._force_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for (OpenAI logprobs' `bytes`). A byte-level BPE token may
        hold part of a UTF-8 character, which decode() can only show as U+FFFD; its spelling in
        GPT-2's byte alphabet, or a SentencePiece byte token (<0xE6>), says which bytes it holds."""
        text = self.decode([i], skip_special_tokens=False)
        piece = self.id_to_token(i)
        if "\ufffd" not in text or piece is None:
            return text.encode()
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        table = unicode_to_bytes()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ConfigError("this tokenizer has no chat_template (tokenizer_config.json / chat_template.jinja)")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of a chat; the template writes its own special tokens (as HF tokenize=True)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids, emitting only completed characters.

    Byte-level tokens can end inside a UTF-8 character; such text decodes to U+FFFD and is held
    back until the next token completes it. Decoding a short window with some preceding context
    (prefix_offset..read_offset) keeps word-boundary handling (e.g. SentencePiece spaces) right.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # ids before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int] | tuple[int, ...]) -> str:
        """Append tokens; return the newly completed text (possibly "")."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix_text) :]
        return ""

    def held(self) -> str:
        """The text of the tokens not emitted yet, as they decode now (U+FFFD for incomplete bytes;
        "" when none), without emitting it."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        return self._decode(self.ids[self.prefix_offset :])[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (incomplete bytes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix_text) :]
