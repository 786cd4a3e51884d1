"""kvpipe on trained weights against HF transformers on the same file: SmolLM2-135M-Instruct's
Q4_1 GGUF (the default model), both in float32, on chat prompts rendered with its template.

- prompt logits: kvpipe's model over paged KV against HF's forward, within logit_atol
  (tests/helpers/tolerance.py: fp32 eps, the logits' magnitude, 30 layers, width 576);
- greedy generation, 64 new tokens at most: the engine (continuous batching of all prompts, the
  serving path) against one batched HF `generate` (left-padded). The tokens must be equal, or differ
  first where HF's own top-2 logits are within 2 * logit_atol of each other (each side may be off
  by logit_atol, so such a step may flip either way and nothing after it is comparable): then the
  gap is printed. Every compared token's logprob must agree within 2 * logit_atol (a logprob is a
  logit minus a logsumexp, each off by at most logit_atol).

Both dequantize the file with gguf-py, so the weights are bit-identical (test_gguf_smollm2.py);
what differs is the arithmetic order of two fp32 implementations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvpipe.config import CacheConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.model.checkpoint.default_model import default_model_path
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers import smollm2_text as smollm2
from tests.helpers.paged_model import incremental_logits
from tests.helpers.tolerance import assert_close_logits, logit_atol

transformers = pytest.importorskip("transformers")

MAX_NEW = 64
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Explain in simple terms how a rainbow forms."}],
    [{"role": "user", "content": "Give me three tips for learning a new language."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is 12 times 12?"},
    ],
    [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am SmolLM, a small AI assistant. How can I help?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
    [{"role": "user", "content": "Describe the water cycle step by step."}],
    [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
    [{"role": "user", "content": "¿Cuál es la capital de España? Responde en español."}],
]


@dataclass(frozen=True)
class HFRun:
    tokens: list[int]  # new tokens, EOS included when it stopped there
    logits: torch.Tensor  # [len(tokens), vocab]: the raw logits each token was chosen from


@pytest.fixture(scope="module")
def path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tok(path: Path) -> Tokenizer:
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode_chat(chat) for chat in CHATS]


@pytest.fixture(scope="module")
def hf(path: Path):
    assert path == smollm2.GGUF_DIR / smollm2.GGUF_NAME
    return smollm2.hf_model()


@pytest.fixture(scope="module")
def ours(path: Path) -> CausalLM:
    model = load_model(path, dtype=torch.float32)
    assert isinstance(model, CausalLM)
    return model


@pytest.fixture(scope="module")
def hf_runs(hf, prompts: list[list[int]]) -> list[HFRun]:
    """One batched `generate` (left-padded, with the attention mask), cut after each row's EOS."""
    pad, eos = int(hf.config.pad_token_id), int(hf.generation_config.eos_token_id)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
        )
    logits = torch.stack(out.logits, 1).float()  # [batch, steps, vocab]
    runs = []
    for row, new in enumerate(out.sequences[:, width:].tolist()):
        n = new.index(eos) + 1 if eos in new else len(new)
        runs.append(HFRun(new[:n], logits[row, :n]))
    return runs


@pytest.fixture(scope="module")
def engine_runs(path: Path, prompts: list[list[int]]) -> list[dict]:
    cfg = ServerConfig(model_path=str(path), cache=CacheConfig(page_size=16, max_total_tokens=8192))
    engine = Engine(cfg)
    try:
        return engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_prompt_logits_match_hf(ours: CausalLM, hf, prompts: list[list[int]], i: int) -> None:
    ids = prompts[i]
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0].float()
        mine = incremental_logits(ours, ids, len(ids), page_size=16).float()
    assert_close_logits(mine, theirs, ours.cfg, len(ids), msg=f"chat {i}")
    atol = logit_atol(theirs, ours.cfg, len(ids))
    print(f"chat {i}: {len(ids)} positions, max |logit - HF| {float((mine - theirs).abs().max()):.3g} <= {atol:.3g}")


def test_greedy_tokens_and_logprobs_match_hf_generate(
    ours: CausalLM, prompts: list[list[int]], hf_runs: list[HFRun], engine_runs: list[dict], tok: Tokenizer
) -> None:
    full, ties, worst = 0, [], 0.0
    for i, (ids, ref, got) in enumerate(zip(prompts, hf_runs, engine_runs)):
        mine = got["output_ids"]
        lps = got["meta_info"]["output_token_logprobs"]
        assert len(lps) == len(mine)
        n = min(len(mine), len(ref.tokens))
        first_diff = next((t for t in range(n) if mine[t] != ref.tokens[t]), None)
        compared = n if first_diff is None else first_diff
        for t in range(compared):
            row = ref.logits[t]
            atol = logit_atol(row, ours.cfg, len(ids) + t)
            want = float(torch.log_softmax(row, -1)[mine[t]])
            assert abs(lps[t] - want) <= 2 * atol, (i, t, lps[t], want, atol)
            worst = max(worst, abs(lps[t] - want))
        if first_diff is None:
            # same tokens; both stopped at EOS at the same place, or both ran to MAX_NEW
            assert len(mine) == len(ref.tokens), (i, mine, ref.tokens)
            full += 1
            continue
        top2 = ref.logits[first_diff].topk(2).values
        gap = float(top2[0] - top2[1])
        atol = logit_atol(ref.logits[first_diff], ours.cfg, len(ids) + first_diff)
        assert gap <= 2 * atol, (
            f"chat {i}: token {first_diff} differs ({mine[first_diff]} vs HF {ref.tokens[first_diff]}) "
            f"where HF's top-2 gap {gap:.3g} exceeds 2 * logit_atol {2 * atol:.3g}"
        )
        ties.append(f"chat {i}: first difference at token {first_diff}, HF top-2 gap {gap:.3g} <= {2 * atol:.3g}")
    print(
        f"{full}/{len(CHATS)} chats equal over all their tokens; near-ties: {ties or 'none'}; "
        f"max |logprob - HF| {worst:.3g}"
    )
    assert full >= len(CHATS) - 2, ties  # a near-tie is rare: most chats must match in full
    assert sum(len(r["output_ids"]) for r in engine_runs) >= 4 * MAX_NEW  # long answers, not just EOS
    assert "Paris" in tok.decode(engine_runs[0]["output_ids"])
