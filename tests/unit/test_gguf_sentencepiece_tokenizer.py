"""kvpipe's SentencePiece BPE tokenizer of a GGUF (kvpipe/model/checkpoint/gguf/sentencepiece.py)
against transformers' GGUF tokenizer of the same file, on a small Gemma-3-style vocabulary
(tests/helpers/sentencepiece_gguf.py: control, user-defined and byte tokens, runs of spaces stored
as spaces, trained BPE pieces with no merges listed, scores against the order): token ids with and
without BOS, decoding with and without the special tokens, on fixed texts (whitespace, unicode
through byte fallback, control and user-defined tokens in the text), a long document and
hypothesis's concatenations of such fragments. Both readers must ignore the scores and respell
the runs of spaces (a reader that does not splits the corpus differently: checked here). The
trained Gemma-3-270M's 262,144-piece tokenizer is test_gemma3_270m_hf_parity.py's (`slow`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpipe.model.checkpoint.gguf.sentencepiece as sp
from kvpipe.model.checkpoint.gguf.checkpoint import GGUFCheckpoint
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.sentencepiece_gguf import corpus_text, write_sentencepiece_gguf

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "The capital of France is Paris.",
    " leading space, trailing space ",
    "   many     spaces\n\n\n\nand newlines   \t\ttabs\t\t\t\t",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\r\n",
    "Numbers: 3.14159, 2024-06-01, 1,234,567 and 0x1F.",
    "emoji 🎉🦀👩‍👩‍👧, 日本語のテキスト, 한국어, Ελληνικά, naïve café, e\u0301",
    "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after<eos> and <unused1>, [multimodal]<start_of_image>",
    "\u0000\u0001 control bytes and a private-use \U0010fffd",  # byte fallback
    "▁ a visible space typed, and ▁▁ two",
]
FRAGMENTS = [
    *(t for t in TEXTS if t),
    " ",
    "  ",
    "   ",
    "\n",
    "\t",
    "the",
    "ing ",
    "é",
    "🎉",
    "<eos>",
    "[multimodal]",
    "<0x41>",  # a byte token's spelling as text: plain characters, not the token
]
FUZZ = settings(  # derandomized, no database: CI sees the same cases, nothing is written into the checkout
    max_examples=200,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sentencepiece_gguf(tmp_path_factory.mktemp("sp") / "sp.gguf")


@pytest.fixture(scope="module")
def ours(path: Path) -> Tokenizer:
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def theirs(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def assert_same(ours: Tokenizer, theirs: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs(text).input_ids, text
    assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False).input_ids, text
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text


def test_vocabulary_is_gemmas_kind(ours: Tokenizer, theirs: Any, path: Path) -> None:
    assert type(theirs).__name__ == "GemmaTokenizer"  # transformers' Gemma builder, as for the 270M
    assert ours.vocab_size == len(theirs)
    assert (ours.bos_token, ours.eos_token_ids) == (theirs.bos_token, (theirs.eos_token_id,))
    assert GGUFCheckpoint.open(path).tokenizer().config["add_bos_token"]


@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_texts_match_transformers(ours: Tokenizer, theirs: Any, i: int) -> None:
    assert_same(ours, theirs, TEXTS[i])


def test_long_document_matches_transformers(ours: Tokenizer, theirs: Any) -> None:
    """The corpus the pieces were trained on, and a file that is not (README: emoji, tables)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for text in (corpus_text(), readme):
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids
        assert ours.decode(ids) == text
    assert len(ours.encode(corpus_text())) < 0.5 * len(corpus_text())  # the trained pieces are used


@FUZZ
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=8).map("".join))
def test_fragment_mixes_match_transformers(ours: Tokenizer, theirs: Any, text: str) -> None:
    assert_same(ours, theirs, text)


@pytest.mark.parametrize("broken", ["scores", "no respelling"])
def test_a_reader_that_ranks_by_score_or_keeps_spaces_differs(
    path: Path, theirs: Any, monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    """Control: the vocabulary tells both mistakes from the right reading."""
    ckpt = GGUFCheckpoint.open(path)
    if broken == "scores":
        scores = ckpt.metadata.get("tokenizer.ggml.scores")

        def by_score(vocab: dict[str, int]) -> list[tuple[str, str]]:
            ranked = sorted(vocab, key=lambda t: -scores[vocab[t]])
            splits = ((t[:k], t[k:]) for t in ranked for k in range(len(t) - 1, 0, -1))
            return [(a, b) for a, b in splits if a in vocab and b in vocab]

        monkeypatch.setattr(sp, "token_order_merges", by_score)
    else:
        monkeypatch.setattr(sp, "respell_spaces", list)
    meta = ckpt.metadata
    wrong = sp.sentencepiece_bpe(meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type"), "<unk>")
    text = corpus_text()
    assert wrong.encode(text, add_special_tokens=False).ids != theirs(text, add_special_tokens=False).input_ids
