"""A PD decode server with NGRAM speculation (in process, local backend): NGRAM needs no draft
state from the prefill (the decode has the prompt's tokens), so the decode drafts from its first
decode step on; greedy tokens and logprobs equal the colocated engine's, drafts are accepted, and
every page on both sides is free afterwards (the decode radix cache on, so only verified KV is
cached)."""

from __future__ import annotations

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.request import FinishReason, SamplingParams
from tests.helpers.pd_pair import assert_pd_matches, make_pair, prompts

GREEDY24 = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def repetitive(n: int) -> list[int]:
    unit = [7 + 3 * n + i * 11 for i in range(n)]
    return unit * (40 // n) + unit[:2]


@pytest.mark.parametrize("decode_radix_cache", [False, True])
def test_speculative_decode_matches_colocated(tiny_model_dir, reference, decode_radix_cache):
    ps = [repetitive(3), repetitive(5)] + prompts(5, [17, 40])
    with make_pair(
        tiny_model_dir,
        24,
        decode_speculative=SpeculativeConfig("NGRAM", num_draft_tokens=5),
        decode_radix_cache=decode_radix_cache,
    ) as pair:
        reqs = [pair.reqs(ids, GREEDY24) for ids in ps]
        pair.run(reqs)
        decoded = [d for _, d in reqs]
        assert all(d.finish_reason is FinishReason.LENGTH for d in decoded)
        assert_pd_matches(decoded, ps, reference, "PD, speculative decode vs colocated")
        c = pair.decode.spec_counts
        assert c.proposed > 0 and c.accepted > 0, c
        assert sum(d.spec.verify_ct for d in decoded if d.spec) == c.verify_ct
        pair.settle()
