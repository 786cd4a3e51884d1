"""`kvpipe bench engine --compare-llamacpp` (bench/engine/llamacpp_reference.py): which llama.cpp type
each --quantization is measured against, the ratio rows and their text, the refusal of a
non-GGUF model, and one real run on the default model's GGUF (llama-cpp-python: bench extra)."""

from __future__ import annotations

import argparse

import pytest

from kvpipe.bench.engine.llamacpp_reference import format_llamacpp, llamacpp_kinds
from kvpipe.bench.engine.stats import (
    DecodePoint,
    PrefillPoint,
    compare_llamacpp_decode,
    compare_llamacpp_prefill,
    summarize_decode,
    summarize_prefill,
)


def _args(*extra: str) -> argparse.Namespace:
    from kvpipe.bench.engine.command import add_args

    parser = argparse.ArgumentParser()
    add_args(parser)
    tiny = ["--prompt-lens", "16", "--prefill-batch", "1", "--batch-sizes", "1,2", "--decode-context", "8"]
    run = ["--output-len", "2", "--decode-warmup-steps", "1", "--repeat", "1", "--warmup", "0", "--threads", "1"]
    return parser.parse_args([*tiny, *run, "--no-progress", *extra])


def test_each_mode_has_its_llamacpp_peer_and_bad_types_are_refused():
    assert [llamacpp_kinds(None, q) for q in (None, "w8a16", "w4a16")] == [["F32"], ["Q8_0"], ["Q4_1"]]
    assert llamacpp_kinds("F32, Q4_1", "w8a16") == ["F32", "Q4_1"]
    with pytest.raises(SystemExit, match="--llamacpp-types takes"):
        llamacpp_kinds("Q3_K", None)


def test_ratios_and_their_text():
    p = summarize_prefill(PrefillPoint(512, 1), [0.5], [1])
    row = compare_llamacpp_prefill(p, {"F32": summarize_prefill(PrefillPoint(512, 1), [1.0], [1])})
    assert row["time_ratio_vs_llamacpp"] == {"F32": pytest.approx(0.5)}
    d = summarize_decode(DecodePoint(1, 256, 1), [[0.03]])
    drow = compare_llamacpp_decode(d, {"Q4_1": summarize_decode(DecodePoint(1, 256, 1), [[0.01]])})
    assert drow["step_ratio_vs_llamacpp"] == {"Q4_1": pytest.approx(3.0)}  # kvpipe 3x slower per token
    report = {
        "config": {"quantization": "w4a16", "compare_llamacpp": {"version": "0.3.x", "threads": 2}},
        "prefill": [row],
        "decode": [drow],
    }
    text = format_llamacpp(report)
    assert "--quantization w4a16" in text and "0.50" in text and "3.00" in text and "Q4_1" in text


def test_a_model_without_a_gguf_is_refused(tiny_model_dir):
    from kvpipe.bench.engine.run import run_bench

    args = _args("--model-path", str(tiny_model_dir), "--compare-llamacpp", "--llamacpp-dir", "/nonexistent")
    with pytest.raises(SystemExit, match="needs a GGUF checkpoint"):
        run_bench(args)


@pytest.mark.slow  # the real model in both engines: ~50 s on the loaded 2-core machine
def test_a_real_run_against_the_same_gguf():
    """w4a16 against llama.cpp on the default model's own Q4_1 file (no conversion): llama.cpp
    rows at batch 1 only, with positive times and ratios."""
    pytest.importorskip("llama_cpp")
    from kvpipe.bench.engine.run import run_bench
    from kvpipe.model.checkpoint.default_model import default_model_path

    gguf = default_model_path()
    report = run_bench(
        _args("--model-path", str(gguf), "--quantization", "w4a16", "--compare-llamacpp", "--llamacpp-dir", "/none")
    )
    lc = report["config"]["compare_llamacpp"]
    assert report["config"]["quantization"] == "w4a16" and lc["files"] == {"Q4_1": str(gguf)} and lc["threads"] == 1
    (p,) = report["prefill"]
    assert p["llamacpp"]["Q4_1"]["ms_per_prefill"] > 0 and p["time_ratio_vs_llamacpp"]["Q4_1"] > 0
    one, two = report["decode"]
    assert one["llamacpp"]["Q4_1"]["steps"] == 2 and one["step_ratio_vs_llamacpp"]["Q4_1"] > 0
    assert "llamacpp" not in two  # one sequence only
