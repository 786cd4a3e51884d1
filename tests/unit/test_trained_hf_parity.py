"""kvpipe on trained weights against HF transformers on the same file, both in float32, on chat
prompts rendered with the file's own template: SmolLM2-135M-Instruct's Q4_1 GGUF (the default
model) and Qwen2.5-Coder-0.5B-Instruct's Q4_K_M (q/k/v biases, an untied head, K-quants) and
Qwen2.5-Coder-1.5B-Instruct's Q4_K_M (head_dim 128) `slow` (`make test-full`); the Qwens also on code
prompts (writing, fixing and editing code: they are coder models).

- prompt logits: kvpipe's model over paged KV against HF's forward, within logit_atol
  (tests/helpers/tolerance.py: fp32 eps, the logits' magnitude, the model's depth and width);
- greedy generation: the engine (continuous batching of all prompts, the serving path) against
  one batched HF `generate` (left-padded). The tokens must be equal, or differ first where HF's
  own top-2 logits are within 2 * logit_atol of each other (each side may be off by logit_atol, so
  such a step may flip either way and nothing after it is comparable): then the gap is printed.
  Every compared token's logprob must agree within 2 * logit_atol (a logprob is a logit minus a
  logsumexp, each off by at most logit_atol).

Both dequantize the file with gguf-py, so the weights are bit-identical (test_gguf_trained.py);
what differs is the arithmetic order of two fp32 implementations.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvpipe.config import CacheConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers import trained_models as trained
from tests.helpers.hf_greedy import HFRun, hf_greedy
from tests.helpers.paged_model import incremental_logits
from tests.helpers.tolerance import assert_close_logits, logit_atol

transformers = pytest.importorskip("transformers")
# a liveness deadline, setup included: loading a Qwen (transformers dequantizes the whole file, kvpipe
# packs it) took 2-8 minutes on a loaded 2-core host
pytestmark = pytest.mark.timeout(1800)

Chat = list[dict[str, str]]
CHATS: list[Chat] = [
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
CODE: list[Chat] = [
    [
        {
            "role": "user",
            "content": "Fix the bug in this function:\n```python\ndef is_even(n):\n    return n % 2 == 1\n```",
        }
    ],
    [
        {"role": "system", "content": "You are a coding assistant. Answer with code only."},
        {
            "role": "user",
            "content": "Rename `x` to `count`:\n```python\nx = 0\nfor item in items:\n    x += 1\nprint(x)\n```",
        },
    ],
    [{"role": "user", "content": "Write a SQL query that counts the orders per customer in a table `orders`."}],
]


@dataclass(frozen=True)
class Case:
    """What one model is asked and what its answers must show."""

    chats: list[Chat]
    max_new: int
    expect: tuple[tuple[int, str], ...]  # (chat index, a substring of its greedy answer)


# SmolLM2 (135M) runs all chats to 64 tokens; the Qwens, 4x and 11x larger, run a subset of the
# chats and the code prompts with shorter answers (make test's time)
CASES = {
    trained.SMOLLM2: Case(CHATS, 64, ((0, "Paris"),)),
    trained.QWEN_05B: Case([CHATS[0], CHATS[4], CHATS[5], CHATS[7], *CODE], 40, ((0, "Paris"), (1, "144"))),
    trained.QWEN_15B: Case([CHATS[0], CHATS[4], CHATS[5], CHATS[7], *CODE], 40, ((0, "Paris"), (1, "144"))),
}


@dataclass(frozen=True)
class HFReference:
    prompt_logits: list[torch.Tensor]  # per prompt [len(prompt), vocab]: HF's forward over it
    runs: list[HFRun]  # per prompt: HF's greedy generation


# the 0.5B in `make test-full` only: its HF load and generate took 2 of make test's minutes, and make test
# keeps what it checks on it through test_gguf_trained.py (every tensor equals transformers') and
# test_pd_trained.py (PD equals colocated); the family's forward against HF is test_model_hf_parity.py's
@pytest.fixture(scope="module", params=trained.params(slow=(trained.QWEN_05B,)))
def model(request: pytest.FixtureRequest) -> trained.TrainedModel:
    return trained.MODELS[request.param]


@pytest.fixture(scope="module")
def case(model: trained.TrainedModel) -> Case:
    return CASES[model.name]


@pytest.fixture(scope="module")
def tok(model: trained.TrainedModel) -> Tokenizer:
    return trained.kvpipe_tokenizer(model.name)


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer, case: Case) -> list[list[int]]:
    return [tok.encode_chat(chat) for chat in case.chats]


@pytest.fixture(scope="module")
def hf(model: trained.TrainedModel, prompts: list[list[int]], case: Case) -> HFReference:
    """Everything compared with transformers, computed before kvpipe's engine loads: the HF model
    (a 5 GB peak for the 0.5B while it loads) is gone before the engine's own load peak."""
    ref = trained.hf_model(model.name)
    try:
        with torch.inference_mode():
            logits = [ref(torch.tensor([ids])).logits[0].float() for ids in prompts]
        return HFReference(logits, hf_generate(ref, prompts, case.max_new))
    finally:
        del ref
        gc.collect()


def hf_generate(hf: Any, prompts: list[list[int]], max_new: int) -> list[HFRun]:
    """hf_greedy with the model's own EOS (its generation config)."""
    return hf_greedy(hf, prompts, max_new, int(hf.generation_config.eos_token_id))


@pytest.fixture(scope="module")
def engine(model: trained.TrainedModel, hf: HFReference) -> Iterator[Engine]:
    """The serving engine (after the HF reference: see `hf`); its model (float32) is also the one
    whose prompt logits are compared."""
    eng = Engine(ServerConfig(model_path=str(model.path()), cache=CacheConfig(page_size=16, max_total_tokens=8192)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def ours(engine: Engine) -> CausalLM:
    m = engine.runner.model
    assert isinstance(m, CausalLM) and next(m.parameters()).dtype == torch.float32
    return m


@pytest.fixture(scope="module")
def engine_runs(engine: Engine, prompts: list[list[int]], case: Case) -> list[dict]:
    return engine.generate(prompts, SamplingParams(max_new_tokens=case.max_new, temperature=0.0))


def test_prompt_logits_match_hf(ours: CausalLM, hf: HFReference, prompts: list[list[int]]) -> None:
    for i, (ids, theirs) in enumerate(zip(prompts, hf.prompt_logits)):
        with torch.inference_mode():
            mine = incremental_logits(ours, ids, len(ids), page_size=16).float()
        assert_close_logits(mine, theirs, ours.cfg, len(ids), msg=f"chat {i}")
        atol = logit_atol(theirs, ours.cfg, len(ids))
        print(
            f"chat {i}: {len(ids)} positions, max |logit - HF| {float((mine - theirs).abs().max()):.3g} <= {atol:.3g}"
        )


def test_greedy_tokens_and_logprobs_match_hf_generate(
    ours: CausalLM,
    prompts: list[list[int]],
    hf: HFReference,
    engine_runs: list[dict],
    tok: Tokenizer,
    case: Case,
) -> None:
    full, ties, worst = 0, [], 0.0
    for i, (ids, ref, got) in enumerate(zip(prompts, hf.runs, engine_runs)):
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
            # same tokens; both stopped at EOS at the same place, or both ran to max_new
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
        f"{full}/{len(prompts)} chats equal over all their tokens; near-ties: {ties or 'none'}; "
        f"max |logprob - HF| {worst:.3g}"
    )
    assert full >= len(prompts) - 2, ties  # a near-tie is rare: most chats must match in full
    assert sum(len(r["output_ids"]) for r in engine_runs) >= 4 * case.max_new  # long answers, not just EOS
    for i, text in case.expect:
        assert text in tok.decode(engine_runs[i]["output_ids"]), (i, tok.decode(engine_runs[i]["output_ids"]))
