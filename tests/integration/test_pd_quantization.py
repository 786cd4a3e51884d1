"""--quantization through PD (tests/helpers/pd_pair.py: a prefill and a decode Engine in one
process over the local backend): with the same flag on both sides, the decode's greedy tokens and
logprobs are the colocated quantized engine's (Route.SAME_PROCESS), a second quantized engine
gives the same bits, and the quantized model really is another model than the fp32 one. A decode
with another --quantization is refused (test_pd_handshake_inprocess.py)."""

from __future__ import annotations

import pytest

from tests.helpers.pd_pair import GREEDY, assert_pd_matches, colocated_greedy, make_pair, prompts
from tests.helpers.tolerance import Route, generation_atol

LENS = [1, 16, 17, 40, 100]


@pytest.mark.parametrize("mode", ["w8a16", pytest.param("w4a16", marks=pytest.mark.slow)])
def test_quantized_pd_matches_colocated_and_is_deterministic(tiny_model_dir, reference, mode):
    ps = prompts(3, LENS)
    first, second = (
        colocated_greedy(tiny_model_dir, quantization=mode),
        colocated_greedy(tiny_model_dir, quantization=mode),
    )
    try:
        ref, again = next(first), next(second)
        with make_pair(tiny_model_dir, 0, quantization=mode) as pair:
            reqs = [pair.reqs(ids) for ids in ps]
            pair.run(reqs)
            assert_pd_matches([d for _, d in reqs], ps, ref, f"PD vs colocated, --quantization {mode}")
            pair.settle()
        # two engines with the same flags: the same tokens and the same logprobs, bit for bit
        assert [again(ids) for ids in ps] == [ref(ids) for ids in ps]
    finally:
        first.close()
        second.close()
    # and not the fp32 model: some prompt's first token or its logprob moves far beyond rounding
    fp32 = [reference(ids, GREEDY) for ids in ps]
    atol = generation_atol(Route.SAME_PROCESS, fp32)
    moved = [
        q.tokens[0] != f.tokens[0] or abs(q.logprobs[0] - f.logprobs[0]) > 10 * atol
        for q, f in zip((ref(ids) for ids in ps), fp32)
    ]
    assert any(moved), f"--quantization {mode} gave the fp32 model's first tokens within {10 * atol:.3g}"
