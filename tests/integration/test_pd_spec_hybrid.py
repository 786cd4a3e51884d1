"""PD (prefill and decode engines in one process, local backend) of the hybrid tiny Qwen3.5 with
speculative decoding on the decode: NGRAM (nothing moves besides the target's KV and state) and
STANDALONE with the target as its own draft (a hybrid draft's recurrent state does not move: the
decode's draft catches up on the prompt at its first step, engine/spec/draft_state.py). Greedy tokens
and logprobs equal the colocated engine's without speculation; the drafts proposed and accepted at
every step equal a colocated speculative engine's for the same request; the draft equal to the
target accepts every draft from the first step; every page, state slot and draft slot is free on
both sides afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, SamplingParams
from kvpipe.model.presets import write_preset
from tests.helpers.engine import colocated_spec_steps
from tests.helpers.pd_pair import PS, assert_pd_matches, colocated_greedy, make_pair, prompts

GREEDY16 = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("tiny_qwen35_spec_pd"))


@pytest.fixture(scope="module")
def reference(model_dir):
    yield from colocated_greedy(model_dir)


def repetitive(n: int) -> list[int]:
    unit = [7 + 3 * n + i * 11 for i in range(n)]
    return unit * (40 // n) + unit[:2]


def colocated_steps(model_dir: Path, spec: SpeculativeConfig, ps: list[list[int]]) -> list[list]:
    return colocated_spec_steps(model_dir, spec, ps, GREEDY16, PS)


def assert_all_free(*engines: Engine) -> None:
    for eng in engines:
        assert eng.state_slots is not None and eng.state_slots.in_use() == {}
        if eng.draft is not None:
            assert eng.draft.states is not None and eng.draft.states.slots.in_use() == {}
            assert not eng.draft.book.seqs


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_speculative_decode_matches_colocated(model_dir, reference, algo):
    spec = (
        SpeculativeConfig("NGRAM", num_draft_tokens=5)
        if algo == "NGRAM"
        else SpeculativeConfig("STANDALONE", num_steps=3, draft_model_path=str(model_dir))
    )
    ps = [repetitive(3), repetitive(5)] + prompts(5, [17, 40])
    with make_pair(
        model_dir, 24, decode_speculative=spec, prefill_speculative=spec if algo == "STANDALONE" else None
    ) as pair:
        reqs = [pair.reqs(ids, GREEDY16) for ids in ps]
        pair.run(reqs, timeout_s=180.0)  # generous: the shared 2-core machine runs other suites too
        decoded = [d for _, d in reqs]
        assert all(d.finish_reason is FinishReason.LENGTH for d in decoded), [d.finish_detail for d in decoded]
        assert_pd_matches(decoded, ps, reference, f"PD {algo} on a hybrid model vs colocated")
        assert [d.spec.steps if d.spec else None for d in decoded] == colocated_steps(model_dir, spec, ps)
        c = pair.decode.spec_counts
        if algo == "STANDALONE":  # the draft is the target: from the first step on
            assert c.proposed > 0 and c.accepted == c.proposed, c
            assert all(d.spec is not None and d.spec.steps[0][1] == 3 for d in decoded)
        else:  # drafts rejected (the tiny preset rarely repeats itself): the state rolled back
            assert c.accepted < c.proposed, c
        pair.settle()
        assert_all_free(pair.prefill, pair.decode)
