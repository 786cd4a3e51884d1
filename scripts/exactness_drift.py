"""How far correct paths move the greedy logprobs of a preset (tests/helpers/tolerance.py's Route
bounds come from these numbers): batched, chunked, paged, layer-grouped and TP runs against each
prompt alone on TP 1.

    PYTHONPATH=. python scripts/exactness_drift.py tiny-qwen3.5 2   # preset, then TP sizes
"""

from __future__ import annotations

import sys
import tempfile

from kvpipe.model.presets import write_preset
from tests.helpers.engine import generations, make_engine, one_at_a_time, prompts
from tests.helpers.tolerance import Generation


def main(name: str, tps: list[int]) -> None:
    model_dir = write_preset(name, tempfile.mkdtemp())
    ps = prompts(6)
    eng = make_engine(model_dir)
    ref = one_at_a_time(eng, ps)
    eng.shutdown()
    lps = [x for g in ref for x in g.logprobs]
    print(f"{name}: reference logprobs in [{min(lps):.3g}, {max(lps):.3g}]")
    runs = [{}, {"chunk": 7}, {"chunk": 33}, {"chunk": 100}, {"page_size": 1, "pages": 4096, "chunk": 33}]
    runs += [{"chunk": 64, "layer_groups": 3}] + [{"tp": tp, "chunk": 33} for tp in tps]
    for kw in runs:
        e = make_engine(model_dir, **kw)
        try:
            report(str(kw), generations(e, ps), ref)
        finally:
            e.shutdown()


def report(label: str, got: list[Generation], ref: list[Generation]) -> None:
    worst, other_tokens = 0.0, 0
    for a, e in zip(got, ref):
        if a.tokens != e.tokens:
            other_tokens += 1
            continue
        worst = max(worst, *(abs(x - y) for x, y in zip(a.logprobs, e.logprobs)))
    print(f"  {label}: largest |logprob difference| {worst:.3g}, prompts with other tokens {other_tokens}")


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2:]])
