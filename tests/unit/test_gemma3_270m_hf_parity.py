"""kvpipe on Gemma-3-270M's trained weights (its Q4_K_M GGUF) against HF transformers on the same
file, both float32, on plain-text prompts (a base model), one of 2,100 tokens: the sliding layers'
window of 512 slides four times.

- the tokenizer: kvpipe's SentencePiece build from the GGUF gives transformers' ids and text
  (`slow`; test_gguf_sentencepiece_tokenizer.py checks the same reader on a small vocabulary);
- weights: the norms (stored by llama.cpp as 1 + w) and the embedding bit for bit;
- prompt logits: kvpipe's model over paged KV against HF's forward, within logit_atol
  (tests/helpers/tolerance.py); the long prompt in chunks of 700, its last 64 positions;
- greedy generation, 32 new tokens at most: the engine (continuous batching, chunked prefill of
  768, window pages only for the sliding layers) against HF's `generate`, tokens and logprobs
  (tests/helpers/hf_greedy.py); one KV page overwritten after the long prompt's prefill fails
  that check (negative control).

Both dequantize the file with gguf-py, so the weights are the same; what differs is the
arithmetic order of two fp32 implementations."""

from __future__ import annotations

import pytest
import torch

from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers import gemma3_270m as g3
from tests.helpers.corrupt_kv import KVCorruption
from tests.helpers.engine import generate_after_prefill
from tests.helpers.paged_model import all_logits, incremental_logits, make_pool
from tests.helpers.tolerance import assert_close_logits, logit_atol

transformers = pytest.importorskip("transformers")

from tests.helpers.hf_greedy import HFRun, assert_greedy_matches_hf, hf_greedy  # noqa: E402

MAX_NEW = 32
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
TOKENIZER_TEXTS = [
    "",
    "The capital of France is Paris.",
    " leading space, trailing space ",
    "   many     spaces\n\n\n\nand newlines   \t\ttabs",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\r\n",
    "Numbers: 3.14159, 2024-06-01, 1,234,567 and 0x1F.",
    "emoji 🎉🦀👩‍👩‍👧, 日本語のテキスト, 한국어, Ελληνικά, naïve café",
    "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after<eos> and <unused7>, [multimodal]",
    "\u0000\u0001 control bytes and a private-use \U0010fffd",  # byte fallback
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return g3.tokenizer()


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(t) for t in g3.TEXTS] + [g3.long_prompt()]


@pytest.fixture(scope="module")
def ours() -> CausalLM:
    model = load_model(g3.path(), dtype=torch.float32)
    assert isinstance(model, CausalLM)
    return model


@pytest.fixture(scope="module")
def hf():
    return g3.hf_model()


@pytest.fixture(scope="module")
def hf_runs(hf, prompts: list[list[int]]) -> list[HFRun]:
    """The short prompts in one batched `generate`, the long one alone (not padded to it)."""
    eos = int(hf.generation_config.eos_token_id)
    return hf_greedy(hf, prompts[:-1], MAX_NEW, eos) + hf_greedy(hf, prompts[-1:], MAX_NEW, eos)


@pytest.fixture(scope="module")
def engine():
    cfg = ServerConfig(
        model_path=str(g3.path()),
        cache=CacheConfig(page_size=16, max_total_tokens=8192),
        scheduler=SchedulerConfig(chunked_prefill_size=768),
    )
    eng = Engine(cfg)
    yield eng
    eng.shutdown()


# slow: transformers rebuilds the 262,144 pieces' merges in Python (half a minute); the same reader
# on a small vocabulary of Gemma's layout is test_gguf_sentencepiece_tokenizer.py's, in `make test`
@pytest.mark.slow
def test_tokenizer_matches_transformers(tok: Tokenizer) -> None:
    theirs = g3.hf_tokenizer()
    for text in [*TOKENIZER_TEXTS, *g3.TEXTS]:
        ids = tok.encode(text)
        assert ids == theirs(text).input_ids, text
        assert tok.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert g3.long_prompt() == theirs(tok.decode(g3.long_prompt())).input_ids[: g3.LONG_TOKENS]


def test_config_and_weights_are_transformers(ours: CausalLM, hf) -> None:
    cfg, h = ours.cfg, hf.config
    assert cfg.sliding_layers == tuple(i for i, t in enumerate(h.layer_types) if t == "sliding_attention")
    assert (len(cfg.sliding_layers), cfg.num_layers, cfg.sliding_window) == (15, 18, 512)
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.attention_scale == h.query_pre_attn_scalar**-0.5 and cfg.tie_word_embeddings
    theirs = dict(hf.named_parameters())
    assert torch.equal(ours.embed_tokens, theirs["model.embed_tokens.weight"])
    for name, p in ours.named_parameters():
        if name.endswith("norm.weight"):  # the 1 llama.cpp added, taken off as transformers does
            assert torch.equal(p, theirs["model." + name]), name


@pytest.mark.parametrize("i", range(len(g3.TEXTS)))
def test_prompt_logits_match_hf(ours: CausalLM, hf, prompts: list[list[int]], i: int) -> None:
    ids = prompts[i]
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0].float()
        mine = incremental_logits(ours, ids, len(ids), page_size=16)
    assert_close_logits(mine, theirs, ours.cfg, len(ids), msg=f"prompt {i}")


def test_long_prompt_logits_match_hf(ours: CausalLM, hf, prompts: list[list[int]]) -> None:
    """2,100 tokens in chunks of 700 behind the cached ones, then the last 64 in one chunk."""
    ids, last, ps = prompts[-1], 64, 16
    table = torch.arange(-(-len(ids) // ps))
    pool = make_pool(ours, len(table), ps)
    with torch.inference_mode():
        for start in range(0, len(ids) - last, 700):
            chunk = ids[start : min(start + 700, len(ids) - last)]
            ours(ForwardBatch.build([chunk], [start], [table], ps), pool)
        mine = ours(all_logits(ForwardBatch.build([ids[-last:]], [len(ids) - last], [table], ps)), pool)
        theirs = hf(torch.tensor([ids]), logits_to_keep=last).logits[0].float()
    assert_close_logits(mine, theirs, ours.cfg, len(ids))
    print(f"max |logit - HF| {float((mine - theirs).abs().max()):.3g} <= {logit_atol(theirs, ours.cfg, len(ids)):.3g}")


def test_greedy_tokens_and_logprobs_match_hf_generate(
    engine: Engine, prompts: list[list[int]], hf_runs: list[HFRun], tok: Tokenizer
) -> None:
    got = generate_after_prefill(engine, prompts, lambda e, r, i: None, PARAMS)
    print(assert_greedy_matches_hf(got, hf_runs, prompts, engine.model_config, min_full=len(prompts) - 2))
    assert sum(len(g.tokens) for g in got) >= 4 * MAX_NEW  # real continuations, not just EOS
    assert "France" in tok.decode(list(got[0].tokens))  # a base model: "...is the capital of the country of France"


def test_a_corrupted_kv_page_fails_the_check(engine: Engine, prompts: list[list[int]], hf_runs: list[HFRun]) -> None:
    """Negative control: one page (tokens 160-175) of the first full layer overwritten after the
    long prompt's prefill makes the comparison fail."""
    full = next(i for i in range(engine.model_config.num_layers) if engine.model_config.window(i) is None)
    hit = KVCorruption(layer=full, page=10)
    got = generate_after_prefill(engine, prompts[-1:], lambda e, r, i: hit.apply(e.runner.pool, r.pages), PARAMS)
    with pytest.raises(AssertionError, match="prompt 0") as failed:
        assert_greedy_matches_hf(got, hf_runs[-1:], prompts[-1:], engine.model_config, min_full=1)
    print(f"corrupted: {str(failed.value).splitlines()[0]}")
