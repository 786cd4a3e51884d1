"""Offline generation: prompts run to completion on an engine driven by the caller's thread
(`kvpipe generate`, benchmarks, tests), answered in SGLang's /generate shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Protocol, TypeGuard, cast

from kvpipe.engine.request import FinishReason, Req, SamplingParams, TokenOutput, finish_reason_json
from kvpipe.model.text.tokenizer import Tokenizer

Prompts = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


class StepEngine(Protocol):
    """What generate() drives (kvpipe.engine.engine.Engine)."""

    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]

    def add_request(self, req: Req) -> None: ...
    def abort(self, rid: str) -> None: ...
    def step(self) -> list[TokenOutput]: ...


def one_prompt(prompts_or_ids: Prompts) -> TypeGuard[str | Sequence[int]]:
    """generate()'s argument is one prompt (text, or token ids), not a list of them."""
    return isinstance(prompts_or_ids, str) or bool(prompts_or_ids and isinstance(prompts_or_ids[0], int))


def generate(
    engine: StepEngine,
    prompts_or_ids: Prompts,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    timeout_s: float = 600.0,
) -> list[dict]:
    """Run prompts (text or token ids, one or a list) to completion; SGLang-shaped results."""
    prompts: list[str | Sequence[int]]
    if one_prompt(prompts_or_ids):
        prompts = [prompts_or_ids]
    else:  # a list of prompts, each text or token ids
        prompts = list(cast("Sequence[str | Sequence[int]]", prompts_or_ids))
    plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
    reqs = []
    for p, sp in zip(prompts, plist):
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
        reqs.append(Req(f"gen-{uuid.uuid4().hex}", ids, sp, engine.eos_token_ids))
    t0 = time.monotonic()
    for r in reqs:
        engine.add_request(r)
    while not all(r.finished for r in reqs):
        if time.monotonic() - t0 > timeout_s:
            for r in reqs:
                engine.abort(r.rid)
            engine.step()
            raise TimeoutError(f"generate did not finish within {timeout_s}s")
        engine.step()
    latency = time.monotonic() - t0
    return [result(engine.tokenizer, r, latency) for r in reqs]


def result(tokenizer: Tokenizer, req: Req, latency: float) -> dict:
    """A finished request as SGLang's /generate answers it (text cut before a matched stop string)."""
    text = tokenizer.decode(req.output_ids)
    if req.finish_reason is FinishReason.STOP and isinstance(req.finish_detail, str):
        cut = text.find(req.finish_detail)
        text = text[:cut] if cut >= 0 else text
    reason = finish_reason_json(req.finish_reason, req.finish_detail, len(req.output_ids))
    return {
        "text": text,
        "output_ids": list(req.output_ids),
        "meta_info": {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "output_token_logprobs": list(req.output_logprobs),
            "e2e_latency": latency,
            **(req.spec.meta_info() if req.spec is not None else {}),
        },
    }
