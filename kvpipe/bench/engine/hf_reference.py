"""HF `transformers` on the same checkpoint, run the way a user of the library would: the
baseline `kvpipe bench engine --compare-hf` reports its ratios against.

- prefill: `model(input_ids [batch, L], logits_to_keep=1)` under inference_mode (what
  `generate` does for the first token, without the sampling loop around it);
- decode: the batch's context is prefilled once (untimed) into a DynamicCache, then each step
  feeds the batch's greedy tokens [batch, 1] with that cache, timed step by step.
Attention is HF's default for the checkpoint (sdpa on CPU); dtype float32 as the engine's.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from kvpipe.bench.engine.stats import DecodePoint, PrefillPoint
from kvpipe.model.checkpoint.gguf.reader import find_gguf


class HFReference:
    """One HF model and a prompt RNG; `threads`: torch threads while it runs (restored after)."""

    def __init__(self, model_path: str, seed: int, threads: int) -> None:
        from transformers import AutoModelForCausalLM  # optional: only --compare-hf needs it

        gguf = find_gguf(model_path)  # transformers reads a GGUF file as (its directory, its name)
        where, kw = (gguf.parent, {"gguf_file": gguf.name}) if gguf is not None else (model_path, {})
        self.model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
        self.vocab = int(self.model.config.vocab_size)
        self.attn = str(self.model.config._attn_implementation)
        self.threads = threads
        self.rng = np.random.default_rng(seed)

    def _prompts(self, batch: int, length: int) -> Any:
        return torch.from_numpy(self.rng.integers(0, self.vocab, size=(batch, length)))

    def _with_threads(self, fn: Any) -> Any:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                return fn()
        finally:
            torch.set_num_threads(before)

    def prefill_once(self, point: PrefillPoint) -> tuple[float, float]:
        """Seconds to prefill `point.batch` prompts of `point.prompt_len` tokens in one forward,
        and the process CPU seconds spent meanwhile."""
        ids = self._prompts(point.batch, point.prompt_len)

        def run() -> tuple[float, float]:
            c0, t0 = time.process_time(), time.perf_counter()
            self.model(ids, logits_to_keep=1)
            return time.perf_counter() - t0, time.process_time() - c0

        return self._with_threads(run)

    def decode_once(self, point: DecodePoint) -> tuple[list[float], float]:
        """Step times (seconds) of `point.steps` greedy decode steps of the whole batch after
        `point.warmup_steps` untimed ones, each against the cache its context was prefilled into;
        and the CPU seconds of the timed steps."""
        ids = self._prompts(point.batch, point.context)

        def run() -> tuple[list[float], float]:
            out = self.model(ids, use_cache=True, logits_to_keep=1)
            cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            times, cpu = [], 0.0
            for i in range(point.warmup_steps + point.steps):
                c0, t0 = time.process_time(), time.perf_counter()
                out = self.model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                if i >= point.warmup_steps:
                    times.append(time.perf_counter() - t0)
                    cpu += time.process_time() - c0
            return times, cpu

        return self._with_threads(run)
