"""The real draft/target pair: Qwen2.5-Coder-1.5B-Instruct as target with Qwen2.5-Coder-0.5B-Instruct
as its STANDALONE draft (one tokenizer: test_gguf_trained.py), both from their GGUFs. Greedy
outputs with speculation equal those without, colocated (fp32) and through PD (a prefill and a
decode engine in this process, the draft on both sides and its KV sent with the target's), on a
code-editing prompt (the answer copies most of the code) and a free-form chat prompt
(kvpipe/bench/engine/spec_decode.py's `code-edit` and `chat` workloads); the draft's proposals are really
accepted, more of them where the answer copies. The PD pair runs --quantization w8a16 (target and
draft): two fp32 engines of both models would hold 16 GB. Those two are `slow` (`make test-full`):
four engines of a 1.5B model, minutes each to load on a loaded 2-core host. `make test` runs the
0.5B drafting for itself, colocated, on fewer tokens: the same STANDALONE path on trained weights,
where a draft equal to the target must have nearly every proposal accepted.

Tolerance: the tokens must be equal. A verify forward computes the target over the last token and
its drafts at once where plain decoding runs one token per step: the same operations on another
number of rows (other GEMM blockings), a reordering of fp32 sums like a TP split, so each logprob
within 2 * logit_atol with SAME_BINARY_TP_GAIN (tests/helpers/tolerance.py) at the prompts' largest
logit magnitude (the PD test of trained models argues the same bound).
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvpipe.bench.engine.spec_decode import CHAT_TURNS
from kvpipe.config import SpeculativeConfig
from kvpipe.engine.request import SamplingParams
from tests.helpers import trained_models as trained
from tests.helpers.engine import generations, make_engine
from tests.helpers.paged_model import incremental_logits
from tests.helpers.pd_pair import make_pair
from tests.helpers.tolerance import SAME_BINARY_TP_GAIN, Generation, Route, assert_same_generations, logit_atol

pytestmark = pytest.mark.timeout(3600)  # a liveness deadline: minutes per 1.5B load on a loaded 2-core host

WORKLOADS = ("code-edit", "chat")
STEPS = 3  # drafts per verify step: an accept length is at most STEPS + 1


def greedy(new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)  # no answer ends within `new`


def standalone(draft: str) -> SpeculativeConfig:
    return SpeculativeConfig("STANDALONE", num_steps=STEPS, draft_model_path=str(trained.gguf_path(draft)))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """The workloads' chat turns (the two models share the tokenizer and template)."""
    tok = trained.kvpipe_tokenizer(trained.QWEN_05B)
    return [tok.encode_chat([{"role": "user", "content": CHAT_TURNS[w]}]) for w in WORKLOADS]


def reference(
    target: str, quantization: str | None, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[Generation], float]:
    """The target alone, greedy (one engine, freed before the next starts), and the logprob bound:
    2 * logit_atol (SAME_BINARY_TP_GAIN) at the prompts' largest logits over the longest context."""
    eng = make_engine(trained.gguf_path(target), pages=64, quantization=quantization)
    try:
        ref = generations(eng, prompts, params)
        with torch.inference_mode():
            m = eng.runner.model
            scale = max(incremental_logits(m, p, len(p), page_size=16).abs().max() for p in prompts)  # type: ignore[arg-type]
        tol = 2 * logit_atol(
            scale.reshape(1), m.cfg, max(map(len, prompts)) + params.max_new_tokens, gain=SAME_BINARY_TP_GAIN
        )
    finally:
        eng.shutdown()
        gc.collect()
    return ref, tol


def check(got: list[dict], want: list[Generation], tol: float, prompts: list[list[int]], what: str) -> list[float]:
    """Outputs as the target alone's and drafts accepted on both workloads; the accept lengths."""
    assert_same_generations([Generation.of(r) for r in got], want, Route.SAME_PROCESS, prompts, what, atol_floor=tol)
    metas = [r["meta_info"] for r in got]
    lengths = [float(m["spec_accept_length"]) for m in metas]
    print(f"{what}: accept length {dict(zip(WORKLOADS, lengths))}, logprob tolerance {tol:.3g}")
    assert all(m["spec_accept_token_num"] > 0 for m in metas), metas
    return lengths


def colocated(target: str, draft: str, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    eng = make_engine(trained.gguf_path(target), pages=64, speculative=standalone(draft))
    try:
        return eng.generate(prompts, params, timeout_s=1800.0)
    finally:
        eng.shutdown()
        gc.collect()


def test_colocated_self_draft_equals_the_model_alone(prompts) -> None:
    """The 0.5B drafting for itself: a draft that computes what the target computes, one row at a
    time where the verify takes STEPS + 1, so only a near-tie flipped by that reordering could
    reject a proposal."""
    params = greedy(16)
    want, tol = reference(trained.QWEN_05B, None, prompts, params)
    got = colocated(trained.QWEN_05B, trained.QWEN_05B, prompts, params)
    lengths = check(got, want, tol, prompts, "colocated STANDALONE (0.5B draft) vs 0.5B alone")
    assert min(lengths) > STEPS, lengths  # nearly every proposal lands


PAIR_PARAMS = greedy(48)


@pytest.mark.slow
def test_colocated_standalone_equals_the_target_alone(prompts) -> None:
    want, tol = reference(trained.QWEN_15B, None, prompts, PAIR_PARAMS)
    got = colocated(trained.QWEN_15B, trained.QWEN_05B, prompts, PAIR_PARAMS)
    lengths = check(got, want, tol, prompts, "colocated STANDALONE (0.5B draft) vs 1.5B alone")
    assert lengths[0] > lengths[1] and lengths[0] > 2.0, lengths  # code-edit copies: most drafts land


@pytest.mark.slow
def test_pd_standalone_equals_the_target_alone(prompts) -> None:
    """Both sides speculative (the prefill runs the draft over the prompt and sends its KV after
    the target's, in 3 layer groups); the decode's radix cache on."""
    want, tol = reference(trained.QWEN_15B, "w8a16", prompts, PAIR_PARAMS)
    spec = standalone(trained.QWEN_05B)
    with make_pair(
        trained.gguf_path(trained.QWEN_15B),
        0,
        quantization="w8a16",
        prefill_speculative=spec,
        decode_speculative=spec,
        decode_radix_cache=True,
        layer_groups=3,
        layer_groups_min_tokens=0,
    ) as pair:
        reqs = [pair.reqs(ids, PAIR_PARAMS) for ids in prompts]
        pair.run(reqs, timeout_s=1800.0)
        got = [
            {
                "output_ids": d.output_ids,
                "meta_info": {"output_token_logprobs": d.output_logprobs, **(d.spec.meta_info() if d.spec else {})},
            }
            for _, d in reqs
        ]
        pair.settle()
    lengths = check(got, want, tol, prompts, "PD STANDALONE (0.5B draft) vs 1.5B alone, w8a16")
    assert lengths[0] > lengths[1] and lengths[0] > 2.0, lengths
