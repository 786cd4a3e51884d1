"""A GGUF file's SentencePiece BPE vocabulary (`tokenizer.ggml.model` "llama") as a `tokenizers`
BPE with byte fallback, built as transformers' GGUF loader builds Gemma's (its gemma_tokenizer and
GemmaTokenizer), so both split every text alike:

- the file lists no merges: each token that two other tokens concatenate to gives a merge
  (left, right); they rank by where the merged token stands in the list (Gemma's scores do not
  follow its merge order, the list does), the longer left piece first among one token's splits;
- a token of two or more spaces is stored as spaces while the model looks it up as "▁▁": it is
  respelled first, so its merges match;
- spaces are normalised to "▁" (no prefix space), unknown characters fall back to the
  `<0xNN>` byte tokens, and decoding undoes both;
- CONTROL tokens are special added tokens, USER_DEFINED ones plain added tokens (matched whole).
"""

from __future__ import annotations

from gguf import TokenType
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

SPACE = "\u2581"  # SentencePiece's visible space


def respell_spaces(tokens: list[str]) -> list[str]:
    """Tokens made only of spaces (two or more) as the model spells them: "  " -> "▁▁"."""
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def token_order_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) of two tokens whose concatenation is a token, best first: by the merged
    token's id, then the longer left piece first."""
    merges: list[tuple[str, str]] = []
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        merges.extend(
            (token[:k], token[k:]) for k in range(len(token) - 1, 0, -1) if token[:k] in vocab and token[k:] in vocab
        )
    return merges


def sentencepiece_bpe(tokens: list[str], types: list[int], unk_token: str | None) -> Tokenizer:
    """tokens, types: tokenizer.ggml.tokens and token_type; unk_token: the unknown token's text."""
    vocab = {t: i for i, t in enumerate(respell_spaces(tokens))}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=token_order_merges(vocab), fuse_unk=True, unk_token=unk_token, byte_fallback=True
        )
    )
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TokenType.CONTROL]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types)
            if k == TokenType.USER_DEFINED and t in vocab
        ]
    )
    return tok
