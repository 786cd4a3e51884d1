"""`bench kv-accuracy`'s comparison of a KV dtype's generations with fp32 KV's (no engine)."""

from __future__ import annotations

import pytest

from kvpipe.bench.accuracy.kv_dtype import compare, format_table


def test_agreement_counts_tokens_before_the_first_difference_and_logprobs_only_there():
    ref = [([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), ([5, 6], [-1.0, -2.0])]
    got = [([1, 2, 9, 4], [-0.1, -0.25, -5.0, -0.4]), ([5, 6], [-1.0, -2.5])]
    r = compare(ref, got)
    # prompt 0 agrees for 2 tokens (the 4th, equal again, follows other text), prompt 1 for both
    assert r["generated_tokens"] == 6 and r["token_agreement"] == pytest.approx(4 / 6)
    assert (r["prompts_identical"], r["prompts"]) == (1, 2)
    assert r["mean_abs_logprob_diff"] == pytest.approx((0 + 0.05 + 0 + 0.5) / 4)
    assert r["max_abs_logprob_diff"] == pytest.approx(0.5)
    table = format_table({"rows": [{"kv_cache_dtype": "fp8_e4m3", **r}]})
    assert "fp8_e4m3" in table and "0.6667" in table and "1/2" in table
