"""Text prompts for `kvpipe bench serve --api chat`: the workload's seeded token ids decoded with
the served model's tokenizer (an HF directory, a .gguf file or a directory holding one), so the
server re-encodes them inside its chat template.

Special tokens are dropped when decoding: a random id that happens to be `<|im_start|>` would
otherwise open a turn of its own inside the user message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpipe.config import ConfigError
from kvpipe.model.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatText:
    """token ids -> text (a `workload.TextOf`), with the tokenizer's vocabulary size (ids drawn at
    or above it would not decode)."""

    tokenizer: Tokenizer

    def __call__(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def open_chat_text(path: str | Path | None) -> ChatText:
    """The tokenizer at `path`; SystemExit with what to pass when there is none or it does not load."""
    if path is None:
        raise SystemExit(
            "kvpipe bench serve: --api chat decodes its prompts with the served model's tokenizer, and the "
            "server reports no local checkpoint; pass --model-path (an HF directory or a .gguf file)"
        )
    try:
        tok = Tokenizer.from_dir(path)
    except (ConfigError, OSError, ValueError) as e:
        raise SystemExit(f"kvpipe bench serve: --api chat: cannot open the tokenizer of {path}: {e}") from None
    if not tok.chat_template:
        raise SystemExit(f"kvpipe bench serve: --api chat: {path} has no chat template for the server to render")
    return ChatText(tok)
