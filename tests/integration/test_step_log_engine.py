"""A real engine's speed lines (kvpipe/engine/step_log.py) and its generated-token counter: a
prefill line per prefill batch, a decode line every 40 decode steps (SGLang's default interval),
`accept len` with speculative decoding, and `generated_tokens` = every token its forwards sampled."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.request import SamplingParams
from tests.helpers.engine import make_engine, prompts

LOGGER = "kvpipe.engine.engine"
DECODE = re.compile(
    r"^Decode batch\. #running-req: (\d+), #token: (\d+), token usage: [\d.]+, (?:accept len: ([\d.]+), )?"
    r"gen throughput \(token/s\): ([\d.]+), #queue-req: (\d+)$"
)


def test_prefill_and_decode_lines(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(tiny_model_dir)
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            results = engine.generate(prompts(3), SamplingParams(max_new_tokens=45, temperature=0.0, ignore_eos=True))
        generated = engine.stats()["generated_tokens"]
    finally:
        engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    prefills = [line for line in lines if line.startswith("Prefill batch.")]
    decodes = [m for m in (DECODE.match(line) for line in lines) if m]
    assert prefills and sum(int(re.search(r"#new-token: (\d+)", p)[1]) for p in prefills) == sum(map(len, prompts(3)))
    assert len(decodes) == 1, lines  # 44 decode steps: one line at the 40th
    m = decodes[0]
    assert int(m[1]) == 3 and m[3] is None and float(m[4]) > 0 and int(m[5]) == 0
    assert generated == sum(r["meta_info"]["completion_tokens"] for r in results) == 3 * 45


def test_accept_length_with_speculation(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(tiny_model_dir, speculative=SpeculativeConfig("NGRAM", num_draft_tokens=5))
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            # a repeating prompt: the request's own n-grams draft its greedy continuation
            engine.generate([[5, 6, 7, 8] * 12], SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True))
        stats = engine.stats()
    finally:
        engine.shutdown()
    decodes = [m for m in (DECODE.match(r.getMessage()) for r in caplog.records if r.name == LOGGER) if m]
    assert decodes and all(m[3] is not None and float(m[3]) >= 1.0 for m in decodes)
    assert stats["avg_spec_accept_length"] >= 1.0 and stats["generated_tokens"] == 120
