"""The server's text path with real byte-level BPE tokenizers (SmolLM2-135M's and
Qwen2.5-Coder's, from their GGUFs: tests/helpers/trained_models.py), against transformers'
tokenizer of the same file: streamed text equals the final decode for any UTF-8 (emoji, ZWJ
sequences, flags, CJK, combining marks, characters split across tokens) and never shows U+FFFD
for a character still incomplete; skip_special_tokens both ways; the chat template's token ids;
stop strings and stop tokens in the engine's FinishChecker and the server's RequestTracker on
real text; each token's bytes in OpenAI logprobs."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvpipe.engine.finish import FinishChecker
from kvpipe.engine.request import FinishReason, Req, SamplingParams, TokenOutput
from kvpipe.model.text.tokenizer import IncrementalDetokenizer, Tokenizer
from kvpipe.server.protocol import GenerateInput, TextOptions
from kvpipe.server.request_tracker import RequestOutput, RequestTracker
from tests.helpers import trained_models as trained

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
FRAGMENTS = [
    "The capital of France is Paris.",
    " hello",
    ", world",
    "\n\n",
    "  \t",
    "🎉",
    "🦀",
    "👩‍👩‍👧",  # a ZWJ sequence: 3 emoji and 2 joiners
    "👍🏽",  # emoji + skin-tone modifier
    "🇫🇷🇯🇵",  # regional-indicator flags
    "日本語のテキスト",
    "中文文本",
    "한국어",
    "e\u0301",  # é as e + combining acute
    "n\u0303a\u0308",  # ñ ä decomposed
    "Z\u0336\u0337",  # stacked combining overlays
    "नमस्ते",  # Devanagari with virama and vowel signs
    "مرحبا",
    "∑∫√",
    "\u200b",  # zero-width space
    "café",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",  # 4-byte mathematical letters
]
# SmolLM2's vocabulary lacks the bytes 0x04 0x06 0x13 0x14 0x16 0x1d and the UTF-8 lead bytes
# 0xf1 0xf2 (U+40000..U+BFFFF, unassigned planes): text with them loses them in both tokenizers
# (test_unencodable_text_drops_like_hf); Qwen2's has all 256 bytes
UNENCODABLE = "\x04\x06\x13\x14\x16\x1d"
# any Unicode scalar but those (for both models), U+FFFD (its own test below) and surrogates (not encodable)
CHARS = st.characters(max_codepoint=0x3FFFF, blacklist_categories=("Cs",), blacklist_characters="\ufffd" + UNENCODABLE)
TEXT = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(CHARS, max_size=6)), max_size=10).map("".join)
TEXT_WITH_SPECIALS = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.sampled_from(SPECIALS), st.text(CHARS, max_size=6)), max_size=10
).map("".join)


@pytest.fixture(scope="module", params=trained.params(trained.SMOLLM2, trained.QWEN_05B))
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)  # the 1.5B has the 0.5B's tokenizer (test_gguf_trained.py)


@pytest.fixture(scope="module")
def tok(model: str) -> Tokenizer:
    return trained.kvpipe_tokenizer(model)


@pytest.fixture(scope="module")
def hf(model: str) -> Any:
    return trained.hf_tokenizer(model)


def stream(tok: Tokenizer, ids: list[int], skip: bool, chunks: list[int] | None = None) -> tuple[list[str], str]:
    """Feed `ids` to an IncrementalDetokenizer (one id at a time, or in chunks of these sizes, the
    last repeated); the pieces it emitted and its flush at the end."""
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = 1 if not chunks else chunks[min(k, len(chunks) - 1)]
        pieces.append(det.add(ids[i : i + n]))
        i, k = i + n, k + 1
    return pieces, det.flush()


@FUZZ
@given(text=TEXT, skip=st.booleans())
def test_streamed_text_is_the_final_decode(tok: Tokenizer, hf: Any, text: str, skip: bool) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    pieces, tail = stream(tok, ids, skip)
    final = tok.decode(ids, skip_special_tokens=skip)
    assert final == text == hf.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) + tail == final
    assert tail == ""  # real text: nothing incomplete is left at the end
    assert not any("\ufffd" in p for p in pieces)  # an incomplete character is held back, never shown


@FUZZ
@given(text=TEXT, chunks=st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_streamed_in_chunks_of_several_ids(tok: Tokenizer, text: str, chunks: list[int]) -> None:
    """A step may bring several tokens at once (a PD decode's first step, speculative decoding)."""
    ids = tok.encode(text, add_special_tokens=False)
    pieces, tail = stream(tok, ids, True, chunks)
    assert "".join(pieces) + tail == text and not any("\ufffd" in p for p in pieces)


def test_unencodable_text_drops_like_hf(model: str, tok: Tokenizer, hf: Any) -> None:
    text = f"a{UNENCODABLE}b\U00050000c\U000b0000d"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    if model == trained.SMOLLM2:  # the lead byte is lost, its three continuation bytes stay (each one U+FFFD)
        assert tok.decode(ids) == hf.decode(ids) == "ab" + "\ufffd" * 3 + "c" + "\ufffd" * 3 + "d"
    else:  # every byte has a token
        assert tok.decode(ids) == hf.decode(ids) == text


def test_characters_really_split_across_tokens(tok: Tokenizer) -> None:
    """The fuzzing above is meaningful: these characters span several tokens, and a token that
    ends inside a character emits nothing until the character is complete. (Qwen2's vocabulary
    has "🦀" and "🇫🇷" as whole tokens; these four are split by both.)"""
    for text in ["🦩", "👩‍👩‍👧", "𝔘𝔫𝔦", "𝄞"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) > 1, text
        pieces, tail = stream(tok, ids, True)
        assert "" in pieces and "".join(pieces) == text and tail == ""
        assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids))), text


@FUZZ
@given(text=TEXT_WITH_SPECIALS, skip=st.booleans())
def test_skip_special_tokens_matches_hf(tok: Tokenizer, hf: Any, text: str, skip: bool) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    want = hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=skip) == want
    pieces, tail = stream(tok, ids, skip)
    assert "".join(pieces) + tail == want and not any("\ufffd" in p for p in pieces)
    if not skip:
        assert want == text


@lru_cache(maxsize=1)
def _vocab_ids(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Token ids a model may emit in any order: byte tokens (a lone UTF-8 lead or continuation
    byte), pieces of real multi-byte characters, special tokens, and any id at all."""
    pieces = sorted({i for f in FRAGMENTS for i in tok.encode(f, add_special_tokens=False)})
    specials = [tok.token_to_id(s) for s in SPECIALS]
    byte_ids = [i for i in range(tok.vocab_size) if len(tok.id_to_token(i) or "") == 1]
    return st.lists(
        st.one_of(
            st.sampled_from(pieces),
            st.sampled_from(byte_ids),
            st.sampled_from([i for i in specials if i is not None]),
            st.integers(0, tok.vocab_size - 1),
        ),
        max_size=24,
    )


@FUZZ
@given(data=st.data(), skip=st.booleans())
def test_any_id_sequence_streams_its_decode(tok: Tokenizer, hf: Any, data: st.DataObject, skip: bool) -> None:
    """Ids in an order no text produces, invalid UTF-8 included: the stream still adds up to the
    decode of all ids, so U+FFFD appears only where the final text has it too."""
    ids = data.draw(_vocab_ids(tok))
    pieces, tail = stream(tok, ids, skip)
    final = tok.decode(ids, skip_special_tokens=skip)
    assert final == hf.decode(ids, skip_special_tokens=skip)
    # every piece is a prefix of the final text's rest: a U+FFFD shown mid-stream is one the final
    # text has at that place (an invalid byte), never a character that was still incomplete
    assert "".join(pieces) + tail == final


def test_literal_replacement_character_is_streamed(tok: Tokenizer) -> None:
    """U+FFFD in the text itself: held while it ends the text, then shown; nothing lost."""
    text = "bad \ufffd byte"
    ids = tok.encode(text, add_special_tokens=False)
    pieces, tail = stream(tok, ids, True)
    assert "".join(pieces) + tail == text


ROLES = st.sampled_from(["user", "assistant"])
MESSAGES = st.tuples(
    st.one_of(st.none(), TEXT),  # the system prompt (both templates add their own when absent)
    st.lists(st.tuples(ROLES, TEXT_WITH_SPECIALS), min_size=1, max_size=5),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=MESSAGES, gen=st.booleans())
def test_chat_template_ids_match_hf(tok: Tokenizer, hf: Any, msgs: tuple, gen: bool) -> None:
    system, turns = msgs
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": r, "content": c} for r, c in turns
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=gen)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
    assert tok.encode_chat(messages, add_generation_prompt=gen) == list(want)


# ---- the server's RequestTracker on real text ----------------------------------------------------


def _track(
    tok: Tokenizer,
    ids: list[int],
    finish: tuple[FinishReason, int | str | None],
    stop: tuple[str, ...] = (),
    no_stop_trim: bool = False,
    skip: bool = True,
) -> list[RequestOutput]:
    """Feed `ids` one token per engine step, the last with the engine's finish; the outputs."""
    inp = GenerateInput(
        rid="r",
        input_ids=(1,),
        params=SamplingParams(max_new_tokens=len(ids) + 1, stop=stop),
        text_options=TextOptions(skip_special_tokens=skip, no_stop_trim=no_stop_trim),
    )
    tr = RequestTracker(inp, IncrementalDetokenizer(tok, skip), start_time=0.0)
    outs = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = tr.update([TokenOutput("r", (t,), (0.0,), *(finish if last else (None, None)))], now=float(i))
        if out is not None:
            outs.append(out)
        if tr.finished:
            break
    return outs


def _check_stream(outs: list[RequestOutput]) -> RequestOutput:
    """Deltas add up to every cumulative text; the last output is the finish."""
    acc = ""
    for o in outs:
        acc += o.delta_text
        assert o.text == acc and "\ufffd" not in o.delta_text
    assert outs[-1].finished
    return outs[-1]


@FUZZ
@given(text=TEXT, data=st.data(), no_stop_trim=st.booleans())
def test_stop_string_on_real_text(tok: Tokenizer, text: str, data: st.DataObject, no_stop_trim: bool) -> None:
    """A stop string cut out of the text anywhere (inside one token, across two or more, in the
    first token, inside a multi-byte character's neighbours): the shown text ends exactly before
    it (or after it with no_stop_trim), and no streamed piece ever showed any of it."""
    assume(len(text) >= 2)
    a = data.draw(st.integers(0, len(text) - 1))
    b = data.draw(st.integers(a + 1, min(len(text), a + 6)))
    stop = text[a:b]
    ids = tok.encode(text, add_special_tokens=False)
    outs = _track(tok, ids, (FinishReason.LENGTH, len(ids)), stop=(stop,), no_stop_trim=no_stop_trim)
    final = _check_stream(outs)
    pos = text.find(stop)
    assert final.text == text[: pos + (len(stop) if no_stop_trim else 0)]
    assert (final.finish_reason, final.finish_detail) == (FinishReason.STOP, stop)
    assert all(stop not in o.text for o in outs[:-1])
    if not no_stop_trim:
        assert stop not in final.text


def test_stop_string_spanning_two_tokens_and_in_the_first(tok: Tokenizer) -> None:
    text = " The capital of France is Paris. It is big."
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:3] == [" The", " capital", " of"]
    # "e c": the end of " The" and the start of " capital"
    final = _check_stream(_track(tok, ids, (FinishReason.LENGTH, len(ids)), stop=("e c",)))
    assert final.text == " Th" and final.output_ids == ids[:2]  # stopped at the token completing it
    # in the first token: nothing shown at all, or up to the stop with no_stop_trim
    final = _check_stream(_track(tok, ids, (FinishReason.LENGTH, len(ids)), stop=("Th",)))
    assert final.text == " " and final.output_ids == ids[:1]
    final = _check_stream(_track(tok, ids, (FinishReason.LENGTH, len(ids)), stop=(" The",), no_stop_trim=True))
    assert final.text == " The" and final.output_ids == ids[:1]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_eos_on_real_text(tok: Tokenizer, hf: Any, skip: bool, no_stop_trim: bool) -> None:
    """The engine stopped at <|im_end|> after a reply with emoji and CJK: the EOS stays in
    output_ids, and in the text only with no_stop_trim and skip_special_tokens=false (as HF's
    decode of the same ids)."""
    eos = tok.eos_token_ids[0]
    ids = [*tok.encode("Sure! 🎉 日本語 é", add_special_tokens=False), eos]
    final = _check_stream(_track(tok, ids, (FinishReason.STOP, eos), no_stop_trim=no_stop_trim, skip=skip))
    shown = ids if no_stop_trim else ids[:-1]
    assert final.text == hf.decode(shown, skip_special_tokens=skip)
    assert final.output_ids == ids and final.finish_detail == eos
    assert final.text.endswith("<|im_end|>") == (no_stop_trim and not skip)


def _engine_stop(tok: Tokenizer, ids: list[int], stop: str) -> tuple[Req, tuple | None]:
    """The engine's finish check fed `ids` one at a time with stop=[stop]: the request (its
    output_ids end where it stopped) and the finish."""
    req = Req("r", [1], SamplingParams(max_new_tokens=len(ids) + 1, stop=(stop,), ignore_eos=True), (2,))
    checker = FinishChecker(tok, (2,), context_length=1 << 20)
    fin = None
    for t in ids:
        req.output_ids.append(t)
        fin = checker.check(req, 1)
        if fin is not None:
            break
    return req, fin


def test_stop_string_ending_before_a_held_partial_character(tok: Tokenizer) -> None:
    """A token ending inside a UTF-8 character (" " + 0xC2, the first byte of "´") is held back by
    the detokenizer, but its complete " " already finishes the stop string "0 ": the engine stops
    at that token, as SGLang (which decodes the tail U+FFFD and all) does. Hypothesis found it."""
    ids = tok.encode("café00 ´", add_special_tokens=False)
    k = next(i for i, t in enumerate(ids) if tok.decode([t], skip_special_tokens=False) == " \ufffd")
    req, fin = _engine_stop(tok, ids, "0 ")
    assert fin == (FinishReason.STOP, "0 ") and req.output_ids == ids[: k + 1]


@FUZZ
@given(text=TEXT_WITH_SPECIALS, data=st.data(), skip=st.booleans())
def test_engine_and_server_stop_at_the_same_place(tok: Tokenizer, text: str, data: st.DataObject, skip: bool) -> None:
    """The engine stops at the first token after which the stop string is in the output, with
    special tokens skipped or as their text (SGLang's rule); the server cuts the text it shows
    right before it when it is there, and shows all of it otherwise (a special token's text,
    skipped)."""
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=data.draw(st.booleans()))
    assume(len(full) >= 2)
    a = data.draw(st.integers(0, len(full) - 1))
    stop = full[a : data.draw(st.integers(a + 1, min(len(full), a + 6)))]
    req, fin = _engine_stop(tok, ids, stop)
    m = next(k for k in range(1, len(ids) + 1) if any(stop in tok.decode(ids[:k], v) for v in (True, False)))
    assert fin == (FinishReason.STOP, stop) and req.output_ids == ids[:m]
    final = _check_stream(_track(tok, req.output_ids, fin, stop=(stop,), skip=skip))
    shown = tok.decode(ids[:m], skip_special_tokens=skip)
    assert final.text == (shown[: shown.index(stop)] if stop in shown else shown)
    assert final.finish_detail == stop


def test_stop_string_naming_a_special_token(tok: Tokenizer) -> None:
    """stop=["<|endoftext|>"] ends the request at that token even when the client does not see
    special tokens (skip_special_tokens, the default); the text has nothing to trim."""
    ids = [*tok.encode("Hi there", add_special_tokens=False), tok.token_to_id("<|endoftext|>")]
    ids += tok.encode("more", add_special_tokens=False)
    req = Req("r", [1], SamplingParams(max_new_tokens=50, stop=("<|endoftext|>",)), (2,))
    checker = FinishChecker(tok, (2,), context_length=1 << 20)
    fins = []
    for t in ids:
        req.output_ids.append(t)
        fins.append(checker.check(req, 1))
    k = ids.index(tok.token_to_id("<|endoftext|>"))
    assert fins[k] == (FinishReason.STOP, "<|endoftext|>") and fins[:k] == [None] * k
    final = _check_stream(_track(tok, ids[: k + 1], (FinishReason.STOP, "<|endoftext|>"), stop=("<|endoftext|>",)))
    assert final.text == "Hi there" and final.finish_detail == "<|endoftext|>"


@FUZZ
@given(text=TEXT)
def test_token_bytes_rebuild_the_text(tok: Tokenizer, text: str) -> None:
    """OpenAI logprobs' `bytes`: the tokens' bytes joined are the text's UTF-8, also where a
    token holds only part of a character (its decoded text is U+FFFD then)."""
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


@FUZZ
@given(data=st.data())
def test_token_bytes_of_any_ids(tok: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(_vocab_ids(tok))
    joined = b"".join(tok.token_bytes(i) for i in ids)
    assert joined.decode("utf-8", errors="replace") == tok.decode(ids, skip_special_tokens=False)
