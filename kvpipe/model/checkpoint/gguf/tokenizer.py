"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built with the `tokenizers` library.

Byte-level BPE (`tokenizer.ggml.model` "gpt2": GPT-2, Llama 3, Qwen2/3, SmolLM): vocabulary,
merges, CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens (as
transformers' GGUF loader does), the pre-tokenizer split llama.cpp uses for `tokenizer.ggml.pre`,
BOS/EOS added as `add_bos_token`/`add_eos_token` say. SentencePiece BPE ("llama") for the
families whose GGUFFamily says how to rebuild its merges (Gemma: sentencepiece.py). What kvpipe's Tokenizer reads from
tokenizer_config.json (special token strings, add_bos_token, chat_template) comes as a dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.config import eos_token_ids
from kvpipe.model.checkpoint.gguf.reader import Metadata
from kvpipe.model.checkpoint.gguf.sentencepiece import sentencepiece_bpe
from kvpipe.model.text.byte_alphabet import bytes_to_unicode

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), as the original tokenizer.json files have them
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(split: str | None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    """Optional single-digit split, then a regex split, then bytes to GPT-2's printable alphabet."""
    steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:  # ByteLevel's built-in regex is GPT-2's
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


# tokenizer.ggml.pre -> (regex, digits first); None: GPT-2's regex
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    **dict.fromkeys(("gpt2", "default", "mpt", "olmo"), (None, False)),
    # llama.cpp splits digits one by one first for these ("\p{N}" before the GPT-2 regex)
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), (None, True)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"), (_LLAMA3_SPLIT, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), (_QWEN2_SPLIT, False)),
}
# tokenizer.ggml.model: llama.cpp names a vocabulary kind after the first model that had it
BYTE_LEVEL_BPE, SENTENCEPIECE_BPE = "gpt2", "llama"
_SPECIAL_IDS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


@dataclass(frozen=True)
class GGUFTokenizer:
    """What kvpipe's Tokenizer is built from: `Tokenizer(tokenizer, config, chat_template, eos_token_ids)`."""

    tokenizer: Tokenizer
    config: dict[str, Any]  # as tokenizer_config.json: *_token strings, add_bos_token, add_eos_token
    chat_template: str | None
    eos_token_ids: tuple[int, ...]  # eos, then eot/eom where the file names them


def build_tokenizer(meta: Metadata, token_order_merges: bool = False) -> GGUFTokenizer:
    """`token_order_merges` (GGUFFamily's): the family's SentencePiece vocabulary ("llama") is read
    as sentencepiece.py says; without it only byte-level BPE ("gpt2") is."""
    kind = meta.require("tokenizer.ggml.model")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [int(TokenType.NORMAL)] * len(tokens)
    if kind not in (BYTE_LEVEL_BPE, SENTENCEPIECE_BPE) or (kind == SENTENCEPIECE_BPE and not token_order_merges):
        raise ConfigError(
            f"{meta.path}: GGUF tokenizer model {kind!r} is not supported here (kvpipe builds byte-level BPE, "
            "'gpt2', and the SentencePiece BPE of families whose merges follow the token order, 'llama')"
        )
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise (as transformers)
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == SENTENCEPIECE_BPE)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    ids: dict[str, int] = {}
    for name, key in _SPECIAL_IDS.items():
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None:
            if not 0 <= int(i) < len(tokens):
                raise ConfigError(f"{meta.path}: tokenizer.ggml.{key}_token_id {i} is outside the vocabulary")
            ids[name] = int(i)
            config[name] = tokens[int(i)]
    if kind == BYTE_LEVEL_BPE:
        tok = _byte_level_bpe(meta, tokens, types)
    else:
        tok = sentencepiece_bpe(tokens, types, config.get("unk_token"))
    bos = ids.get("bos_token") if config["add_bos_token"] else None
    eos = ids.get("eos_token") if config["add_eos_token"] else None
    tok.post_processor = _post_processor(tokens, bos, eos)
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return GGUFTokenizer(tok, config, template, eos_token_ids(meta))


def _byte_level_bpe(meta: Metadata, tokens: list[str], types: list[int]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(
            f"{meta.path}: GGUF pre-tokenizer {pre!r} is not supported; kvpipe knows {sorted(PRE_TOKENIZERS)}"
        )
    merges: list[str] = meta.require("tokenizer.ggml.merges")
    spelled = bytes_to_unicode()
    alphabet = set(spelled.values())
    # llama.cpp stores a few tokens in plain UTF-8 rather than the byte alphabet; respell them so the
    # BPE model finds them (transformers' byte_level_tokenizer does the same)
    vocab = {
        t if set(t) <= alphabet else "".join(spelled[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    pairs = [_merge_pair(meta, m) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _byte_level(*PRE_TOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    # A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would grow
    # the vocabulary past the embedding (transformers skips them too).
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types)
        if k == TokenType.CONTROL and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TokenType.USER_DEFINED
    ]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    return tok


def _merge_pair(meta: Metadata, merge: str) -> tuple[str, str]:
    """ "a b" -> ("a", "b"): byte-level tokens spell a space as "Ġ", so the one space separates."""
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ConfigError(f"{meta.path}: malformed tokenizer.ggml.merges entry {merge!r}")
    return left, right


def _post_processor(tokens: list[str], bos: int | None, eos: int | None) -> processors.PostProcessor | None:
    """BOS/EOS around each sequence as add_bos_token/add_eos_token ask (HF's Llama/GPT-2 layout)."""
    if bos is None and eos is None:
        return None
    around = [tokens[bos]] if bos is not None else [], [tokens[eos]] if eos is not None else []

    def seq(piece: str, type_id: int) -> list[str]:  # pieces "<token>:<type id>", one list entry each
        return [f"{p}:{type_id}" for p in (*around[0], piece, *around[1])]

    specials = [(tokens[i], i) for i in dict.fromkeys((bos, eos)) if i is not None]
    return processors.TemplateProcessing(single=seq("$A", 0), pair=seq("$A", 0) + seq("$B", 1), special_tokens=specials)
