"""A PD decode server with NGRAM speculation (in process, local backend): NGRAM needs no draft
state from the prefill (the decode has the prompt's tokens), so the decode drafts from its first
decode step on; greedy tokens and logprobs equal the colocated engine's, drafts are accepted, and
every page on both sides is free afterwards (the decode radix cache on, so only verified KV is
cached); and the same through sglang-router with real servers. A STANDALONE draft model needs
its draft KV from the prefill: test_pd_standalone.py."""

from __future__ import annotations

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.request import FinishReason, SamplingParams
from tests.helpers.pd_pair import assert_pd_matches, make_pair, prompts
from tests.helpers.pd_stack import generate, greedy, start_stack
from tests.helpers.tolerance import Generation, Route, assert_same_generations

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


def test_speculative_decode_through_router(tiny_model_dir, tmp_path, reference):
    """prefill + NGRAM decode + sglang-router (Mooncake over loopback): the router hands back the
    decode's answer, spec_* fields included; tokens and logprobs equal the colocated engine's."""
    pytest.importorskip("mooncake.engine")
    ps = [repetitive(3), repetitive(5)] + prompts(6, [30])
    stack = start_stack(
        tiny_model_dir,
        tmp_path,
        "--page-size",
        "16",
        "--max-total-tokens",
        "8192",
        "--chunked-prefill-size",
        "24",
        decode_args=("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"),
    )
    try:
        outs = [
            generate(stack.router, {"input_ids": p, "sampling_params": greedy(24), "return_logprob": True}) for p in ps
        ]
        want = [reference(p, GREEDY24) for p in ps]
        assert_same_generations([Generation.of(o) for o in outs], want, Route.ACROSS_PROCESSES, ps, "PD speculative")
        metas = [o["meta_info"] for o in outs]
        assert all(m["spec_verify_ct"] + m["spec_accept_token_num"] == 23 for m in metas), metas
        assert sum(m["spec_accept_token_num"] for m in metas) > 0
        d = stack.decode.wait_idle()
        stack.prefill.wait_idle()
        assert d["spec_accepted_tokens"] == sum(m["spec_accept_token_num"] for m in metas)
    except AssertionError:
        print(stack.logs())
        raise
    finally:
        stack.close()
