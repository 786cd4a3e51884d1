"""A small GGUF with a SentencePiece BPE vocabulary laid out as Gemma 3's file lays out its 262,144
pieces (`tokenizer.ggml.model` "llama", no merges), so kvpipe's tokenizer of it can be checked
against transformers' GGUF tokenizer in a second instead of rebuilding the trained Gemma's:

- CONTROL tokens first (<pad> <eos> <bos> <unk> <mask>, <unusedN>, <start_of_turn>...), then
  USER_DEFINED ones: "[multimodal]", runs of newlines and tabs, and runs of spaces stored as
  spaces (respelled "▁▁"... by both readers before the merges are built);
- the 256 `<0xNN>` BYTE tokens (byte fallback for every character not in the vocabulary);
- the pieces of a BPE trained here on this repository's docs (spaces as "▁", no pre-tokenizer:
  pieces may span words), each listed where its merge ranks, the characters they are made of
  last (as Gemma lists its alphabet); emoji, CJK and most accented letters are left out, so
  they fall back to bytes;
- scores that do not follow the list (Gemma's do not: both readers rank merges by position).

The file has a one-layer gemma3 header and only the embedding tensor: enough for kvpipe's
GGUFCheckpoint and transformers' AutoTokenizer, which read the metadata alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType
from tokenizers import Tokenizer, models, normalizers, trainers

SPACE = "\u2581"
CONTROL = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<unused0>",
    "<unused1>",
    "<start_of_turn>",
    "<end_of_turn>",
]
USER_DEFINED = ["[multimodal]", "\n", "\n\n", "\n\n\n", "\t\t", "\t\t\t", "  ", "   ", "    ", "<start_of_image>"]
BPE_PIECES = 600  # trained pieces, the alphabet included
CORPUS = ("docs/architecture.md", "docs/security.md")
# characters a trained piece may hold (the rest of the corpus is cut out, so it falls back to bytes)
ALPHABET = set(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"()[]{}<>-_=+*/\\#%&|`~@$^\nçéèàü"
)


def corpus_text() -> str:
    root = Path(__file__).resolve().parents[2]
    text = "\n".join((root / f).read_text() for f in CORPUS)
    return "".join(c for c in text if c in ALPHABET)


def trained_pieces() -> list[str]:
    """Pieces of a BPE trained on the corpus, alphabet first, then each merged piece in merge
    order (the order the tokens list keeps: a piece's position is its merge's rank)."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.Replace(" ", SPACE)
    trainer = trainers.BpeTrainer(vocab_size=BPE_PIECES, show_progress=False)
    bpe.train_from_iterator(corpus_text().split("\n\n"), trainer)
    return [t for t, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]


def vocabulary() -> tuple[list[str], list[int]]:
    """tokenizer.ggml.tokens and token_type, Gemma's order: control, user-defined, bytes, pieces
    (merged ones first, single characters last)."""
    pieces = [p for p in trained_pieces() if p not in USER_DEFINED]
    singles = [p for p in pieces if len(p) == 1]
    merged = [p for p in pieces if len(p) > 1]
    tokens = [*CONTROL, *USER_DEFINED, *(f"<0x{b:02X}>" for b in range(256)), *merged, *singles]
    types = (
        [TokenType.CONTROL] * len(CONTROL)
        + [TokenType.USER_DEFINED] * len(USER_DEFINED)
        + [TokenType.BYTE] * 256
        + [TokenType.NORMAL] * (len(merged) + len(singles))
    )
    assert len(set(tokens)) == len(tokens), "a piece twice"
    return tokens, [int(t) for t in types]


def write_sentencepiece_gguf(path: Path) -> Path:
    tokens, types = vocabulary()
    # scores against the list's order (reversed, shuffled): a reader that ranked merges by score would split differently
    scores = np.random.default_rng(0).permutation(len(tokens)).astype(np.float32).tolist()
    w = GGUFWriter(str(path), "gemma3")
    hidden = 8
    for key, value in {
        "context_length": 512,
        "embedding_length": hidden,
        "block_count": 1,
        "feed_forward_length": 16,
        "attention.head_count": 1,
        "attention.head_count_kv": 1,
        "attention.key_length": hidden,
        "attention.value_length": hidden,
        "attention.sliding_window": 16,
    }.items():
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.rope.freq_base", 1_000_000.0)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    for key, token in (("bos", "<bos>"), ("eos", "<eos>"), ("unknown", "<unk>"), ("padding", "<pad>")):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(token))
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
