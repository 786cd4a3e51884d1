"""Bookkeeping of `kvpipe bench engine` (no timing asserted) and its CLI wiring."""

import argparse
import math

import pytest

from kvpipe.bench.engine.stats import (
    DecodePoint,
    PrefillPoint,
    compare_decode,
    compare_prefill,
    cpu_per_wall,
    decode_max_new_tokens,
    decode_points,
    format_table,
    kv_tokens_needed,
    median,
    parse_int_list,
    prefill_points,
    summarize_decode,
    summarize_prefill,
)


def test_parse_int_list_keeps_order_and_drops_duplicates():
    assert parse_int_list("256, 1024,256,2048", "--prompt-lens") == (256, 1024, 2048)
    for bad in ("", "0,8", "a,2", "-1"):
        with pytest.raises(SystemExit):
            parse_int_list(bad, "--batch-sizes")


def test_points_cover_batch_one_and_the_batched_prefill():
    pts = prefill_points([256, 1024], [4])
    assert pts == [PrefillPoint(256, 1), PrefillPoint(256, 4), PrefillPoint(1024, 1), PrefillPoint(1024, 4)]
    assert prefill_points([64], [1]) == [PrefillPoint(64, 1)]
    assert decode_points([1, 8], 256, 64, 2) == [DecodePoint(1, 256, 64, 2), DecodePoint(8, 256, 64, 2)]


def test_decode_token_budget_covers_interleaved_prefill_steps():
    # one prefill step for the whole batch: the timed steps, one early step per request, the first token
    assert decode_max_new_tokens(DecodePoint(8, 256, 64), 8192) == 64 + 8 * 2 + 1
    # chunks of 100 tokens: each 256-token prompt needs 3 prefill steps, so more early decode steps
    assert decode_max_new_tokens(DecodePoint(2, 256, 10), 100) == 10 + 2 * 4 + 1
    # untimed warm-up steps come out of the same token budget
    assert decode_max_new_tokens(DecodePoint(2, 256, 10, warmup_steps=3), 100) == 3 + 10 + 2 * 4 + 1
    need = kv_tokens_needed([PrefillPoint(2048, 4)], [DecodePoint(32, 256, 64)], 8192)
    assert need == max(4 * 2048, 32 * (256 + 64 + 32 * 2 + 1))


def test_median_and_prefill_throughput():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 4.0]) == 2.5
    with pytest.raises(ValueError):
        median([])
    r = summarize_prefill(PrefillPoint(1024, 4), [2.0, 1.0, 4.0], [1, 1, 2])
    assert r["ms_per_prefill"] == pytest.approx(2000.0)
    assert r["tokens_per_s"] == pytest.approx(4 * 1024 / 2.0)
    assert (r["ms_min"], r["ms_max"], r["steps"], r["repeats"]) == (1000.0, 4000.0, 1, 3)
    assert r["cpu_per_wall"] is None
    r = summarize_prefill(PrefillPoint(8, 1), [1.0, 1.0, 1.0], [1, 1, 1], [cpu_per_wall(2.0, 1.0), 0.5, 1.5])
    assert r["cpu_per_wall"] == pytest.approx(1.5)
    assert cpu_per_wall(1.0, 0.0) == 0.0


def test_decode_throughput_is_batch_over_median_step_time():
    # repeat means: 0.02, 0.04, 0.01 -> median 0.02 s per step
    reps = [[0.01, 0.03], [0.04, 0.04], [0.01, 0.01]]
    r = summarize_decode(DecodePoint(8, 256, 2), reps)
    assert r["ms_per_step"] == pytest.approx(20.0)
    assert r["tokens_per_s"] == pytest.approx(8 / 0.02)
    assert r["ms_per_step_p50"] == pytest.approx(20.0)  # median of the six steps: (10 + 30) / 2
    assert r["ms_per_step_max"] == pytest.approx(40.0)
    assert r["ms_per_step_by_repeat"] == pytest.approx([20.0, 40.0, 10.0])
    assert summarize_decode(DecodePoint(8, 256, 2), reps, [1.9, 0.7, 1.2])["cpu_per_wall"] == pytest.approx(1.2)
    with pytest.raises(ValueError):
        summarize_decode(DecodePoint(8, 256, 2), [[0.01], []])
    assert math.isinf(summarize_decode(DecodePoint(1, 8, 1), [[0.0]])["tokens_per_s"])


def test_format_table_lists_every_point():
    report = {
        "machine": {"cpu": "cpu", "threads": 2, "torch": "2.x"},
        "config": {
            "model": "preset:bench",
            "tp_size": 1,
            "page_size": 64,
            "chunked_prefill_size": 8192,
            "repeat": 3,
            "warmup": 1,
            "decode_context": 256,
            "output_len": 64,
            "decode_warmup_steps": 4,
        },
        "prefill": [
            summarize_prefill(PrefillPoint(256, 1), [0.5], [1]),
            summarize_prefill(PrefillPoint(2048, 4), [8.0], [1]),
        ],
        "decode": [summarize_decode(DecodePoint(32, 256, 1), [[0.25]], [1.87])],
    }
    text = format_table(report)
    assert "2048" in text and "1024" in text  # 2048x4 tokens in 8 s -> 1024 tok/s
    assert "128.0" in text  # 32 tokens per 0.25 s step
    assert "1.87" in text


def test_cli_registers_bench_engine():
    from kvpipe.cli import build_parser

    parser, runners = build_parser(["bench", "engine", "--help"])
    assert ("bench", "engine") in runners
    args = parser.parse_args(["bench", "engine", "--preset", "tiny", "--batch-sizes", "1,8", "--json"])
    assert isinstance(args, argparse.Namespace)
    assert (args.preset, args.batch_sizes, args.json, args.output_len) == ("tiny", "1,8", True, 64)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "engine", "--preset", "tiny", "--model-path", "/x"])


def test_hf_ratios_and_their_columns():
    kv = compare_prefill(
        summarize_prefill(PrefillPoint(1024, 1), [0.8], [1]), summarize_prefill(PrefillPoint(1024, 1), [1.0], [1])
    )
    assert kv["time_ratio_vs_hf"] == pytest.approx(0.8) and kv["hf"]["ms_per_prefill"] == pytest.approx(1000.0)
    dec = compare_decode(
        summarize_decode(DecodePoint(32, 256, 1), [[0.05]]), summarize_decode(DecodePoint(32, 256, 1), [[0.1]])
    )
    assert dec["throughput_ratio_vs_hf"] == pytest.approx(2.0)  # half the step time: twice the tokens/s
    report = {
        "machine": {"cpu": "cpu", "threads": 2, "torch": "2.x"},
        "config": {
            "model": "m",
            "tp_size": 1,
            "page_size": 64,
            "chunked_prefill_size": 8192,
            "repeat": 1,
            "warmup": 0,
            "decode_context": 256,
            "output_len": 1,
            "decode_warmup_steps": 0,
            "compare_hf": {"attn_implementation": "sdpa", "threads": 2},
        },
        "prefill": [kv],
        "decode": [dec],
    }
    text = format_table(report)
    assert "kvpipe/HF time" in text and "0.80" in text and "2.00" in text and "HF transformers sdpa" in text


def test_compare_hf_runs_both_on_the_same_checkpoint(tmp_path):
    """A real (tiny) run: the HF rows come from the HF model, one per point, with positive times."""
    from kvpipe.bench.engine.command import add_args
    from kvpipe.bench.engine.run import run_bench

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(
        [
            "--preset",
            "tiny",
            "--prompt-lens",
            "32",
            "--prefill-batch",
            "2",
            "--batch-sizes",
            "2",
            "--decode-context",
            "16",
            "--output-len",
            "2",
            "--decode-warmup-steps",
            "1",
            "--repeat",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--compare-hf",
            "--no-progress",
        ]
    )
    report = run_bench(args)
    assert report["config"]["compare_hf"]["threads"] == 1
    assert [(r["prompt_len"], r["batch"]) for r in report["prefill"]] == [(32, 1), (32, 2)]
    for r in report["prefill"]:
        assert r["hf"]["ms_per_prefill"] > 0 and r["time_ratio_vs_hf"] > 0
    (d,) = report["decode"]
    assert d["hf"]["steps"] == 2 and d["hf"]["batch"] == 2 and d["throughput_ratio_vs_hf"] > 0


def test_compare_dtype_and_floors_in_a_real_run():
    """A real (tiny) run in bf16 against fp32: every point has the fp32 engine's row and the ratio,
    and its floor from the rates measured in the run (positive; not compared with the times: the
    tiny model's weights fit in the caches, so its steps may beat the memory floor)."""
    from kvpipe.bench.engine.command import add_args
    from kvpipe.bench.engine.run import run_bench

    parser = argparse.ArgumentParser()
    add_args(parser)
    flags = "--preset tiny --prompt-lens 32 --prefill-batch 1 --batch-sizes 1 --decode-context 16 --output-len 2"
    flags += " --repeat 1 --warmup 0 --threads 1 --no-progress --dtype bfloat16 --compare-dtype float32"
    report = run_bench(parser.parse_args(flags.split()))
    assert report["config"]["compare_dtype"] == "float32" and report["peaks"]["dtype"] == "bfloat16"
    assert report["peaks"]["bandwidth_gb_s"] > 0 and report["peaks"]["matmul_tflop_s"] > 0
    (p,) = report["prefill"]
    assert p["other_dtype"]["dtype"] == "float32" and p["time_ratio_vs_dtype"] > 0
    (d,) = report["decode"]
    assert d["other_dtype"]["ms_per_step"] > 0 and d["step_ratio_vs_dtype"] > 0
    assert d["weight_bytes"] > 0 and d["kv_bytes"] > 0
    for row in (p, d):
        assert row["floor_ms"] > 0 and row["x_floor"] > 0


def test_matmul_size_stops_where_a_pass_gets_slow():
    """The peak's product grows from 256 while a pass is quick, and stops at the first slow one (a
    bf16 matmul without bf16 units) or at 2,048."""
    from kvpipe.bench.engine.peaks import MATMUL_N, MATMUL_PASS_S, matmul_size

    asked: list[int] = []

    def timed(rate: float):
        def pass_seconds(n: int) -> float:
            asked.append(n)
            return 2.0 * n**3 / rate

        return pass_seconds

    assert matmul_size(timed(1e12)) == MATMUL_N  # fast: up to the largest
    assert asked == [256, 512, 1024]
    asked.clear()
    slow = 2.0 * 256**3 / MATMUL_PASS_S / 4  # a 256-cube pass takes 4x the target
    assert matmul_size(timed(slow)) == 256 and asked == [256]
    asked.clear()
    assert matmul_size(timed(2.0 * 1024**3 / MATMUL_PASS_S / 1.5)) == 1024 and asked == [256, 512, 1024]
