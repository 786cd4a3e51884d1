"""Greedy generation of a trained model, kvpipe's engine against HF transformers' `generate` on the
same weights, both float32: the check the trained-model parity tests share.

The tokens must be equal, or differ first where HF's own top-2 logits are within 2 * logit_atol of
each other (each side may be off by logit_atol, so such a step may flip either way and nothing
after it is comparable). Every compared token's logprob must agree within 2 * logit_atol (a
logprob is a logit minus a logsumexp, each off by at most logit_atol; tests/helpers/tolerance.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.helpers.tolerance import Generation, ModelShape, logit_atol


@dataclass(frozen=True)
class HFRun:
    tokens: list[int]  # new tokens, EOS included when it stopped there
    logits: torch.Tensor  # [len(tokens), vocab]: the raw logits each token was chosen from


@torch.inference_mode()
def hf_greedy(hf, prompts: list[list[int]], max_new: int, eos: int) -> list[HFRun]:
    """One batched `generate` (left-padded, with the attention mask), each row cut after its EOS."""
    pad = int(hf.config.pad_token_id or 0)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    logits = torch.stack(out.logits, 1).float()  # [batch, steps, vocab]
    runs = []
    for row, new in enumerate(out.sequences[:, width:].tolist()):
        n = new.index(eos) + 1 if eos in new else len(new)
        runs.append(HFRun(new[:n], logits[row, :n].clone()))  # a copy: the batch's stack can go
    return runs


def assert_greedy_matches_hf(
    got: list[Generation], hf_runs: list[HFRun], prompts: list[list[int]], shape: ModelShape, min_full: int
) -> str:
    """kvpipe's generations `got` against HF's runs of the same prompts, as the module says; at least
    `min_full` of them equal over all their tokens. Returns a summary line (ties, worst logprob)."""
    full, ties, worst = 0, [], 0.0
    for i, (ids, ref, mine) in enumerate(zip(prompts, hf_runs, got, strict=True)):
        toks, lps = list(mine.tokens), mine.logprobs
        assert len(lps) == len(toks)
        n = min(len(toks), len(ref.tokens))
        first_diff = next((t for t in range(n) if toks[t] != ref.tokens[t]), None)
        for t in range(n if first_diff is None else first_diff):
            row = ref.logits[t]
            atol = logit_atol(row, shape, len(ids) + t)
            want = float(torch.log_softmax(row, -1)[ref.tokens[t]])
            assert abs(lps[t] - want) <= 2 * atol, f"prompt {i}, token {t}: logprob {lps[t]} vs HF {want} (atol {atol})"
            worst = max(worst, abs(lps[t] - want))
        if first_diff is None:
            # same tokens; both stopped at EOS at the same place, or both ran to the limit
            assert len(toks) == len(ref.tokens), (i, toks, ref.tokens)
            full += 1
            continue
        top2 = ref.logits[first_diff].topk(2).values
        gap = float(top2[0] - top2[1])
        atol = logit_atol(ref.logits[first_diff], shape, len(ids) + first_diff)
        assert gap <= 2 * atol, (
            f"prompt {i}: token {first_diff} differs ({toks[first_diff]} vs HF {ref.tokens[first_diff]}) "
            f"where HF's top-2 gap {gap:.3g} exceeds 2 * logit_atol {2 * atol:.3g}"
        )
        ties.append(f"prompt {i}: first difference at token {first_diff}, HF top-2 gap {gap:.3g} <= {2 * atol:.3g}")
    assert full >= min_full, ties  # a near-tie is rare: most prompts must match in full
    return f"{full}/{len(got)} equal over all their tokens; near-ties: {ties or 'none'}; max |logprob - HF| {worst:.3g}"
