"""`kvpipe bench engine --speculative-algorithm NGRAM`: decode tokens/s with and without speculative
decoding on an editing workload, where the answer repeats much of the prompt.

Two engines on the same checkpoint and settings, one with speculation, run the same greedy
requests repeat by repeat, alternating (load drift on a shared machine hits both alike). A
request's decode time runs from the step that gave it its first token to the one that finished
it; decode tokens/s = (completion tokens - 1) / that time, summed over the batch. Outputs must be
equal both ways (greedy speculation changes nothing but the speed); the acceptance length is the
tokens each verify step emitted (1 + accepted drafts).

The workloads: `edit` is a chat turn asking to repeat a paragraph with its typos fixed (a trained
chat model copies most of it); `code-edit` one asking to rename identifiers in a short Python
module and answer with the whole code (a coder model copies most of it); `chat` a free-form
question whose answer is new text (what a draft model must guess, nothing to copy); `repeat` is
prompts that repeat a random unit of tokens (for the random presets: their n-grams predict the
continuation only where the model itself repeats).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvpipe.config import CacheConfig, ServerConfig, SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import Req, SamplingParams

EDIT_INSTRUCTION = "Rewrite the following paragraph exactly, only fixing its spelling mistakes:\n\n"
EDIT_TEXT = (
    "The quick brown fox jumpd over the lazy dog while the farmer was wathcing from the porch. "
    "Every morning he woke up early, fed the chickens, and walked down to the river to check "
    "the nets. In the afternon he repaired the fence that the storm had broken last week, and "
    "in the evening he sat by the fire reading old newspapers about the harvest."
)


CODE_EDIT_INSTRUCTION = (
    "Rename the function `calc` to `average` and the parameter `lst` to `values` everywhere in this code. "
    "Reply with the whole updated code only.\n\n"
)
CODE_EDIT_TEXT = """```python
def calc(lst):
    \"\"\"The mean of lst, 0.0 when it is empty.\"\"\"
    if not lst:
        return 0.0
    total = 0
    for x in lst:
        total += x
    return total / len(lst)


def report(lst):
    print("count:", len(lst))
    print("mean:", calc(lst))
    print("max:", max(lst) if lst else None)
```"""
CHAT_QUESTION = (
    "Explain to a new programmer what a hash table is, how it deals with collisions, "
    "and when they should use one instead of a list."
)
# the chat turn of each chat workload
CHAT_TURNS = {
    "edit": EDIT_INSTRUCTION + EDIT_TEXT,
    "code-edit": CODE_EDIT_INSTRUCTION + CODE_EDIT_TEXT,
    "chat": CHAT_QUESTION,
}


@dataclass(frozen=True)
class SpecSample:
    """One repeat of one engine over the batch."""

    outputs: tuple[tuple[int, ...], ...]
    decode_tokens: int  # completion tokens after each request's first, summed
    decode_s: float  # summed per-request decode times
    verify_ct: int
    proposed: int
    accepted: int
    emitted: int  # tokens the verify steps emitted

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


WORKLOADS = (*CHAT_TURNS, "repeat")


def workload(engine: Engine, kind: str, batch: int, seed: int) -> list[list[int]]:
    """`batch` prompts of workload `kind` (WORKLOADS)."""
    tok = engine.tokenizer
    if kind in CHAT_TURNS:
        ids = tok.encode_chat([{"role": "user", "content": CHAT_TURNS[kind]}])
        return [list(ids) for _ in range(batch)]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(batch):
        unit = rng.integers(3, engine.model_config.vocab_size, size=3 + i % 5).tolist()
        out.append(unit * (96 // len(unit)))
    return out


def run_once(engine: Engine, prompts: list[list[int]], params: SamplingParams, tag: str) -> SpecSample:
    reqs = [Req(f"{tag}-{i}", list(p), params) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while len(done) < len(reqs):
        engine.step()
        now = time.perf_counter()
        for r in reqs:
            if r.output_ids and r.rid not in first:
                first[r.rid] = now
            if r.finished and r.rid not in done:
                done[r.rid] = now
    spec = [r.spec for r in reqs if r.spec is not None]
    return SpecSample(
        tuple(tuple(r.output_ids) for r in reqs),
        sum(len(r.output_ids) - 1 for r in reqs),
        sum(done[r.rid] - first[r.rid] for r in reqs),
        sum(s.verify_ct for s in spec),
        sum(s.proposed for s in spec),
        sum(s.accepted for s in spec),
        sum(s.emitted for s in spec),
    )


def compare(
    cfg: ServerConfig, spec: SpeculativeConfig, kind: str, batch: int, output_len: int, repeat: int, seed: int
) -> dict[str, Any]:
    """Decode tokens/s and acceptance of `spec` against no speculation (cfg's engine settings)."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0)
    cache = replace(spec_cache(cfg.cache, output_len, batch), radix_cache=False)  # every repeat prefills
    plain_cfg = replace(cfg, cache=cache, speculative=SpeculativeConfig())
    engines = [Engine(plain_cfg), Engine(replace(plain_cfg, speculative=spec))]
    try:
        prompts = workload(engines[0], kind, batch, seed)
        for i, eng in enumerate(engines):  # warm-up: kernels built, first-call costs paid
            run_once(eng, prompts, replace(params, max_new_tokens=4), f"warm{i}")
        samples: list[list[SpecSample]] = [[], []]
        for k in range(repeat):
            for i, eng in enumerate(engines):
                samples[i].append(run_once(eng, prompts, params, f"r{k}e{i}"))
    finally:
        for eng in engines:
            eng.shutdown()
    off, on = samples
    tps_off = statistics.median(s.tokens_per_s for s in off)
    tps_on = statistics.median(s.tokens_per_s for s in on)
    last = on[-1]
    return {
        "algorithm": spec.algorithm,
        "num_draft_tokens": spec.max_drafts + 1,
        "workload": kind,
        "batch": batch,
        "prompt_tokens": len(prompts[0]),
        "output_len": output_len,
        "completion_tokens": [len(o) for o in last.outputs],
        "outputs_equal": all(a.outputs == b.outputs for a, b in zip(off, on)),
        "decode_tokens_per_s_off": tps_off,
        "decode_tokens_per_s_on": tps_on,
        "speedup": tps_on / tps_off if tps_off > 0 else 0.0,
        "accept_length": last.emitted / last.verify_ct if last.verify_ct else 0.0,
        "accept_rate": last.accepted / last.proposed if last.proposed else 0.0,
        "samples_off": [s.tokens_per_s for s in off],
        "samples_on": [s.tokens_per_s for s in on],
    }


MAX_PROMPT_TOKENS = 2048  # the workload's prompts stay below this


def spec_cache(cache: CacheConfig, output_len: int, batch: int) -> CacheConfig:
    """A KV pool for `batch` requests of the workload (both engines get one each)."""
    tokens = batch * (MAX_PROMPT_TOKENS + output_len + 2 * cache.page_size)
    return replace(cache, max_total_tokens=max(cache.max_total_tokens, tokens), num_pages=None)


def format_spec(r: dict[str, Any]) -> str:
    return (
        f"speculative {r['algorithm']} ({r['num_draft_tokens']} tokens/verify), {r['workload']} workload, "
        f"batch {r['batch']}, prompt {r['prompt_tokens']} tokens, completions {r['completion_tokens']}: "
        f"decode {r['decode_tokens_per_s_off']:.1f} -> {r['decode_tokens_per_s_on']:.1f} tok/s "
        f"({r['speedup']:.2f}x), accept length {r['accept_length']:.2f}, accept rate {r['accept_rate']:.2f}, "
        f"outputs equal: {r['outputs_equal']}"
    )
