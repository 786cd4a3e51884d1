"""One Engine's prefill and decode, timed step by step through its own loop (Engine.add_request +
Engine.step): time.perf_counter around the steps, and time.process_time for the CPU seconds per
wall second the benchmark really had (TP children excluded)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from kvpipe.bench.engine.stats import DecodePoint, PrefillPoint, cpu_per_wall, decode_max_new_tokens
from kvpipe.engine.request import FinishReason, Req, SamplingParams

STEP_LIMIT = 100_000  # no run of a point takes more engine steps than this


class EngineBench:
    """Drives one Engine through the benchmark points; holds the prompt RNG and rid counter."""

    def __init__(self, engine: Any, seed: int) -> None:
        self.engine = engine
        self.vocab = engine.model_config.vocab_size
        self.rng = np.random.default_rng(seed)
        self._rids = itertools.count()

    def _add(self, n: int, prompt_len: int, max_new_tokens: int) -> list[Any]:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        reqs = []
        for _ in range(n):
            ids = self.rng.integers(0, self.vocab, size=prompt_len).tolist()
            req = Req(f"bench-{next(self._rids)}", ids, params)
            self.engine.add_request(req)
            reqs.append(req)
        return reqs

    def _fail_if_aborted(self, reqs: list[Any]) -> None:
        bad = [r for r in reqs if r.finish_reason is FinishReason.ABORT]
        if bad:
            raise RuntimeError(f"benchmark request {bad[0].rid} was aborted: {bad[0].finish_detail}")

    def prefill_once(self, point: PrefillPoint) -> tuple[float, int, float]:
        """Seconds to prefill `point.batch` prompts together, the engine steps it took, and the
        process CPU seconds per wall second meanwhile."""
        reqs = self._add(point.batch, point.prompt_len, 1)
        steps, c0, t0 = 0, time.process_time(), time.perf_counter()
        while not all(r.finished for r in reqs):
            self.engine.step()
            steps += 1
            if steps > STEP_LIMIT:
                raise RuntimeError("prefill did not finish")
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        self._fail_if_aborted(reqs)
        return elapsed, steps, cpu_per_wall(cpu, elapsed)

    def decode_once(self, point: DecodePoint, budget: int) -> tuple[list[float], float]:
        """Step times (seconds) of `point.steps` decode steps that each advance the full batch,
        after `point.warmup_steps` such steps left untimed; and their CPU seconds per wall second."""
        reqs = self._add(point.batch, point.context, decode_max_new_tokens(point, budget))
        times: list[float] = []
        cpu: list[float] = []
        want = point.warmup_steps + point.steps
        try:
            for _ in range(STEP_LIMIT):
                if len(times) == want or any(r.finished for r in reqs):
                    break
                s = self.engine.stats()
                full = s["num_decoding"] == point.batch and s["num_prefilling"] == 0 and s["num_waiting"] == 0
                before = [len(r.output_ids) for r in reqs]
                c0, t0 = time.process_time(), time.perf_counter()
                self.engine.step()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                # timed only if it was a decode step of the whole batch (every request got 1 token)
                if full and all(len(r.output_ids) == b + 1 for r, b in zip(reqs, before)):
                    times.append(dt)
                    cpu.append(dc)
            self._fail_if_aborted(reqs)
            if len(times) < want:
                raise RuntimeError(f"only {len(times)} of {want} full-batch decode steps ran")
        finally:
            for r in reqs:
                self.engine.abort(r.rid)
            self.engine.step()  # drains the aborts: pages go back before the next point
        if self.engine.has_work():
            raise RuntimeError("benchmark requests left in the engine after a decode run")
        timed = times[point.warmup_steps :]
        return timed, cpu_per_wall(sum(cpu[point.warmup_steps :]), sum(timed))
