"""Helpers shared by the engine integration tests."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig, SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import Req, SamplingParams, TokenOutput
from tests.helpers.tolerance import Generation, Route, assert_same_generations, generation_atol

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


def prompts(n: int = 6, seed: int = 0, vocab: int = 250) -> list[list[int]]:
    """Token-id prompts of mixed lengths (1 to 150 tokens), deterministic."""
    rnd = random.Random(seed)
    lens = [1, 5, 17, 64, 100, 150][:n] + [rnd.randint(2, 90) for _ in range(max(0, n - 6))]
    return [[rnd.randrange(3, vocab) for _ in range(k)] for k in lens]


def make_engine(
    model_dir: Path,
    page_size: int = 16,
    chunk: int = 0,
    tp: int = 1,
    pages: int = 256,
    max_prefill_tokens: int = 16384,
    radix_cache: bool = False,
    kv_cache_dtype: str = "auto",
    speculative: SpeculativeConfig | None = None,
    request_metrics: bool = True,
    quantization: str | None = None,
    mixed_chunk: bool = False,
    **kw,
) -> Engine:
    """An engine on the tiny model; the prefix cache is off unless asked for, so page counts
    are exact (tests/integration/test_prefix_cache.py covers the cache)."""
    cfg = ServerConfig(
        model_path=str(model_dir),
        tp_size=tp,
        cache=CacheConfig(page_size=page_size, num_pages=pages, radix_cache=radix_cache, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(
            chunked_prefill_size=chunk, max_prefill_tokens=max_prefill_tokens, enable_mixed_chunk=mixed_chunk
        ),
        speculative=speculative or SpeculativeConfig(),
        request_metrics=request_metrics,
        quantization=quantization,
    )
    return Engine(cfg, **kw)


def output_ids(engine: Engine, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r["output_ids"] for r in engine.generate(ps, params)]


def generations(engine: Engine, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[Generation]:
    """Greedy tokens and their logprobs of the prompts, run together (one batch where they fit)."""
    return [Generation.of(r) for r in engine.generate(ps, params)]


def one_at_a_time(engine: Engine, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[Generation]:
    return [generations(engine, [p], params)[0] for p in ps]


def reference_outputs(model_dir: Path, ps: list[list[int]]) -> list[Generation]:
    """Greedy generations of each prompt alone on a fresh TP 1 engine (whole prefill, page size 16)."""
    eng = make_engine(model_dir)
    try:
        return one_at_a_time(eng, ps)
    finally:
        eng.shutdown()


def assert_engine_matches(
    engine: Engine,
    ps: list[list[int]],
    reference: list[Generation],
    route: Route = Route.SAME_PROCESS,
    params: SamplingParams = GREEDY,
    what: str = "",
) -> None:
    """The engine's generations of `ps` (run together) equal `reference` in tokens and logprobs
    (tolerance.assert_same_generations): the exactness check of the engine tests."""
    assert_same_generations(generations(engine, ps, params), reference, route, ps, what)


def generate_after_prefill(
    engine: Engine,
    ps: list[list[int]],
    after_prefill: Callable[[Engine, Req, int], None],
    params: SamplingParams = GREEDY,
    timeout_s: float = 120.0,
) -> list[Generation]:
    """Engine.generate with a pause per request: right after the step that finished prompt i's
    prefill (its first token sampled, no decode step yet), `after_prefill(engine, req, i)` runs,
    then decoding goes on. The negative controls corrupt the KV there (tests/helpers/corrupt_kv.py)."""
    reqs = [Req(f"ctl-{i}", list(p), params) for i, p in enumerate(ps)]
    for r in reqs:
        engine.add_request(r)
    end = time.monotonic() + timeout_s
    pending = set(range(len(reqs)))
    while not all(r.finished for r in reqs):
        assert time.monotonic() < end, f"not done after {timeout_s}s: {engine.stats()}"
        engine.step()
        for i in sorted(i for i in pending if reqs[i].prefill_done):
            assert len(reqs[i].output_ids) == 1, "a decode step ran before the pause"
            after_prefill(engine, reqs[i], i)
            pending.discard(i)
    return [Generation.of_req(r) for r in reqs]


def other_context(ps: list[list[int]], seed: int = 99, vocab: int = 250) -> list[list[int]]:
    """Each prompt (of 2+ tokens) with every token but the last replaced by other random ones."""
    rnd = random.Random(seed)
    out = []
    for p in ps:
        assert len(p) >= 2, "a 1-token prompt has no context to change"
        other = [rnd.randrange(3, vocab) for _ in p[:-1]]
        out.append([t if t != old else (t + 1) % vocab + 3 for t, old in zip(other, p)] + [p[-1]])
    return out


# How far a changed context must move a logprob where the tokens stay: far beyond the
# cross-process tolerance (the context-dependent presets change the first token of most prompts
# and move the first logprob of the others by 4e-2 and more, at 150 tokens; the presets of
# format version 1, which mostly continued their last token, left 3 to 5 of 6 outputs unchanged).
CONTEXT_FACTOR = 100.0


def assert_context_matters(
    generate: Engine | Callable[[list[list[int]]], list[Generation]], ps: list[list[int]], reference: list[Generation]
) -> None:
    """The prompts `ps` (2+ tokens each), with every token but the last changed, give other
    generations than `reference` (the prompts' own): each one's tokens differ, or (the same tokens
    throughout) a logprob moves by more than CONTEXT_FACTOR times the cross-process tolerance, and
    the greedy tokens change for most prompts. `generate`: an Engine, or prompts -> generations."""
    assert len(ps) >= 3 and all(len(p) >= 2 for p in ps), "prompts without a context to change"
    run = (lambda x: generations(generate, x)) if isinstance(generate, Engine) else generate
    got = run(other_context(ps))
    floor = CONTEXT_FACTOR * generation_atol(Route.ACROSS_PROCESSES, reference)
    moved = [
        a.tokens != e.tokens or max(abs(x - y) for x, y in zip(a.logprobs, e.logprobs)) > floor
        for a, e in zip(got, reference)
    ]
    assert all(moved), f"logprobs moved by less than {floor:.3g}: {list(zip(got, reference))}"
    changed = sum(a.tokens != e.tokens for a, e in zip(got, reference))
    assert 2 * changed > len(ps), f"only {changed} of {len(ps)} greedy outputs changed with the context"


def check_sampled_speculation(
    path: Path, speculative: SpeculativeConfig, prompt: list[int], leaves_nothing: Callable[[Engine], None]
) -> None:
    """temperature > 0 with speculation: drafts are verified by speculative sampling (its
    distribution: tests/unit/test_spec_sampling.py). A seeded request is reproducible and runs to
    max_new_tokens; a near-zero temperature accepts drafts (`prompt` must draw some); top_k=1 is
    greedy, as without speculation; then `leaves_nothing` checks the engine's pages."""
    plain = make_engine(path)
    spec = make_engine(path, speculative=speculative, radix_cache=True)
    try:
        params = SamplingParams(max_new_tokens=16, temperature=0.7, seed=7, ignore_eos=True)
        first = output_ids(spec, [prompt], params)
        assert first == output_ids(spec, [prompt], params) and len(first[0]) == 16
        assert spec.spec_counts.proposed > 0
        before = spec.spec_counts.accepted
        cold = replace(params, temperature=1e-3, seed=None)
        assert len(output_ids(spec, [prompt, prompt], cold)[1]) == 16
        assert spec.spec_counts.accepted > before
        top1 = replace(params, top_k=1)
        assert output_ids(spec, [prompt], top1) == output_ids(plain, [prompt], top1)
        leaves_nothing(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def step_until_finished(engine: Engine, reqs: list[Req], max_steps: int = 2000) -> list[TokenOutput]:
    """Step `engine` until every request in `reqs` finished (at most `max_steps` steps: a request
    that never ends fails the test instead of hanging it); the outputs the steps returned."""
    outs: list[TokenOutput] = []
    for _ in range(max_steps):
        if all(r.finished for r in reqs):
            return outs
        outs.extend(engine.step())
    raise AssertionError(f"not finished after {max_steps} steps: {[r.rid for r in reqs if not r.finished]}")


def assert_every_draft_accepted(
    eng: Engine,
    ps: list[list[int]],
    reference: list[Generation],
    params: SamplingParams,
    verify_steps: int,
    label: str,
) -> None:
    """A drafter that predicts the target exactly (a draft equal to the target, an MTP layer that
    is the target's bigram): output as the reference, every draft accepted, each request's
    max_new_tokens - 1 tokens after the prefill's emitted in `verify_steps` verify steps; again
    with every prompt behind its cached prefix."""
    assert_engine_matches(eng, ps, reference, Route.SAME_PROCESS, params, label)
    c = eng.spec_counts
    assert c.proposed > 0 and c.accepted == c.proposed, c  # accept rate 1.0
    assert c.emitted == c.verify_ct + c.accepted == (params.max_new_tokens - 1) * len(ps)
    assert c.verify_ct == verify_steps * len(ps)
    assert_engine_matches(eng, ps, reference, Route.SAME_PROCESS, params, f"{label}, cached")
    assert eng.spec_counts.accepted == eng.spec_counts.proposed


def colocated_spec_steps(
    model_dir: Path,
    spec: SpeculativeConfig,
    ps: list[list[int]],
    params: SamplingParams,
    page_size: int,
    chunk: int = 0,
) -> list[list]:
    """Each prompt's (drafts, accepted) per verify step on a colocated speculative engine, the
    prompts served together: what a PD decode must propose step by step for the same requests."""
    eng = make_engine(model_dir, page_size=page_size, chunk=chunk, speculative=spec)
    try:
        reqs = [Req(f"colocated-{i}", list(p), params) for i, p in enumerate(ps)]
        for r in reqs:
            eng.add_request(r)
        step_until_finished(eng, reqs)
        assert all(r.spec is not None for r in reqs)
        return [r.spec.steps for r in reqs if r.spec is not None]
    finally:
        eng.shutdown()
