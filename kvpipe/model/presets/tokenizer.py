"""A byte-level BPE tokenizer for the built-in presets, built with the `tokenizers` library.

Ids 0..255 are the 256 bytes (GPT-2 byte-to-unicode alphabet), then a fixed list of English
merges, then the special tokens. Any text round-trips; construction is deterministic.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from kvpipe.model.text.byte_alphabet import bytes_to_unicode

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")

# Merges in priority order, in plain text (" " is the byte-level "Ġ"). Each right side must
# already be a token when its merge is listed.
_MERGES = (
    (" ", "t"),
    (" ", "a"),
    ("h", "e"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("r", "e"),
    (" ", "s"),
    (" ", "w"),
    ("a", "t"),
    ("e", "n"),
    ("o", "r"),
    ("i", "t"),
    ("i", "s"),
    ("e", "s"),
    ("o", "u"),
    (" t", "he"),
    ("in", "g"),
    (" ", "o"),
    (" ", "c"),
    (" a", "n"),
    (" an", "d"),
    (" ", "i"),
    (" ", "b"),
    (" ", "f"),
    (" ", "m"),
    (" ", "p"),
    ("l", "l"),
    (" ", "h"),
    ("e", "d"),
    (" o", "f"),
    (" t", "o"),
    (" i", "s"),
    ("a", "r"),
)


def _bl(text: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def build_tokenizer() -> Tokenizer:
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    merges = []
    for a, b in _MERGES:
        a, b = _bl(a), _bl(b)
        if a not in vocab or b not in vocab:
            raise AssertionError(f"merge {a!r} + {b!r} uses an unknown token")
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    return tok
