"""Every benchmark's plot renders a PNG from a small result, `kvpipe bench plot` tells a result's
kind from its shape and redraws recorded docs/bench results, and --plot writes the PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvpipe import cli
from kvpipe.bench.accuracy.plot import plot_accuracy
from kvpipe.bench.engine.plot import mode_label, plot_engine, plot_speculative
from kvpipe.bench.output import add_output_args, write_outputs
from kvpipe.bench.plot_command import plot_files
from kvpipe.bench.result_kind import ResultKind, kind_of, load_results
from kvpipe.bench.serve.plot import result_plot
from kvpipe.bench.serve.runs_plot import link_points, plot_compare_runs, plot_link_sweep
from kvpipe.bench.transfer.plot import plot_transfer

DOCS_BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC, path


def engine_report(quant: str = "none", ref: str | None = "llamacpp", spec: bool = False) -> dict[str, Any]:
    def ours_and_ref(pt: dict[str, Any], key: str, ref_value: float) -> dict[str, Any]:
        if ref == "llamacpp":
            return pt | {"llamacpp": {"Q8_0": {key: ref_value}}}
        return pt | ({"hf": {key: ref_value}} if ref == "hf" else {})

    report: dict[str, Any] = {
        "config": {"model": "/m/SmolLM2.gguf", "quantization": quant, "decode_fused_layer": "auto"},
        "machine": {"cpu": "Some CPU", "cpu_count": 2, "threads": 1},
        "prefill": [ours_and_ref({"prompt_len": 512, "batch": 1, "ms_per_prefill": 1300.0}, "ms_per_prefill", 1500.0)],
        "decode": [ours_and_ref({"batch": b, "ms_per_step": 9.0 * b}, "ms_per_step", 12.0) for b in (1, 8)],
    }
    if spec:
        report |= {"prefill": [], "decode": []}
        report["speculative"] = {
            "algorithm": "NGRAM",
            "workload": "edit",
            "batch": 1,
            "speedup": 4.67,
            "accept_length": 6.8,
            "decode_tokens_per_s_off": 10.1,
            "decode_tokens_per_s_on": 47.0,
        }
    return report


def transfer_report(tp: bool = False) -> dict[str, Any]:
    cfg = {"layers": 12, "kv_heads": 4, "head_dim": 64, "dtype": "float32", "page_size": 16, "repeat": 3}
    if tp:
        cfg |= {"prefill_tp": 2, "decode_tp": 4, "link_rate": "loopback"}
        row = {"same_ms": 50.0, "plain_ms": 150.0, "staged_ms": 25.0, "plain_ops": 6144, "staged_ops": 4}
        return {"mode": "tp", "config": cfg, "lengths": [{"prompt_len": 1024, "staged_vs_same": 0.5, **row}]}
    rows = [
        {"prompt_len": n, "goodput_gbps": 2.1, "raw_goodput_gbps": 1.8, "best_raw_goodput_gbps": 2.2}
        | {"best_raw_ratio_paired": 0.95}
        for n in (1024, 4096)
    ]
    return {"config": cfg, "lengths": rows, "goodput_gbps": 2.1}


def accuracy_result(key: str = "kv_cache_dtype") -> dict[str, Any]:
    row = {"token_agreement": 0.85, "prompts_identical": 24, "prompts": 32}
    rows = [{key: v, **row, "mean_abs_logprob_diff": 2.7e-3, "max_abs_logprob_diff": 4.5e-2} for v in ("a", "b")]
    return {"config": {"model_path": "/m", "num_prompts": 32, "output_len": 96}, "rows": rows}


def serve_row(mode: str, n: int, ttft: float, exposed: float | None = None, groups: int | None = None) -> dict:
    return {
        "prompt_len": n,
        "mode": mode,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft * 1.2,
        "exposed_transfer_ms": exposed,
        "num_groups": groups,
        "ideal_transfer_ms": 2000.0 * n / 2048,
        "t_over_c": 2000.0 * n / 2048 / 2500.0,
        "kv_bytes_per_request": 1 << 20,
    }


def sweep_result(rate: float = 1.0, compare: bool = False, concurrency: int = 1) -> dict[str, Any]:
    c = 2500.0 * rate
    rows = [
        serve_row("inproc", 2048, c),
        serve_row("baseline", 2048, c + 2000, 2000.0, 1),
        serve_row("pipelined", 2048, c + 300, 300.0, 12),
        serve_row("inproc", 256, 300.0),
        serve_row("baseline", 256, 800.0, 500.0, 1),
        serve_row("pipelined", 256, 480.0, 180.0, 12),
    ]
    workload = {"num_requests": 8, "concurrency": concurrency, "num_prefix_groups": 0, "num_turns": 1}
    result: dict[str, Any] = {
        "link_rate": "150mbit",
        "modes": ["inproc", "baseline", "pipelined"],
        "workload": workload,
        "rows": rows,
        "interleaved": True,
        "machine": {"cpu": "Some CPU", "cores": 2},
    }
    if compare:
        figures = {"e2e_p50_ms": 600.0 * concurrency, "ttft_p50_ms": 300.0 * concurrency}
        ratio = {"e2e_p50_ms": 1.2, "ttft_p50_ms": 1.5}
        colocated = {k: v / 1.3 for k, v in figures.items()}
        result |= {"modes": ["pd", "inproc"], "rows": [serve_row("pd", 128, 300.0), serve_row("inproc", 128, 200.0)]}
        result["compare"] = [{"prompt_len": 128, "pd": figures, "colocated": colocated, "ratio": ratio}]
    return result


@pytest.mark.parametrize("ref", ["llamacpp", "hf", None])
def test_engine_plot_with_and_without_a_reference(tmp_path: Path, ref: str | None) -> None:
    reports = [engine_report("none", ref), engine_report("w8a16", ref)]
    assert_png(plot_engine(reports, tmp_path / "e.png"))
    assert [mode_label(r, reports) for r in reports] == ["fp32", "w8a16"]


def test_speculative_plot(tmp_path: Path) -> None:
    assert_png(plot_speculative([engine_report(spec=True)], tmp_path / "s.png"))
    assert_png(plot_engine([engine_report(spec=True)], tmp_path / "s2.png"))  # dispatches to it


@pytest.mark.parametrize("tp", [False, True])
def test_transfer_plot(tmp_path: Path, tp: bool) -> None:
    assert_png(plot_transfer(transfer_report(tp), tmp_path / "t.png"))


@pytest.mark.parametrize("key", ["kv_cache_dtype", "quantization"])
def test_accuracy_plot(tmp_path: Path, key: str) -> None:
    assert_png(plot_accuracy(accuracy_result(key), tmp_path / "a.png"))


def test_serve_plots_one_result_and_several(tmp_path: Path) -> None:
    assert_png(result_plot(sweep_result(), tmp_path / "sweep.png"))
    modes = sweep_result() | {"workload": sweep_result()["workload"] | {"num_turns": 4, "turn_len": 64}}
    assert_png(result_plot(modes, tmp_path / "modes.png"))
    assert_png(result_plot(sweep_result(compare=True), tmp_path / "cmp.png"))
    assert_png(plot_link_sweep([sweep_result(r) for r in (0.8, 1.0, 1.3)], tmp_path / "link.png"))
    compares = [sweep_result(compare=True, concurrency=c) for c in (1, 4, 16)]
    assert_png(plot_compare_runs(compares, tmp_path / "cmps.png"))


def test_link_points_give_the_bound() -> None:
    p = link_points(sweep_result(1.0), "pipelined")
    assert p is not None
    # C 2,500 ms, T 2,000 ms, N 12: bound = max(0, T - C) + 1.5 C / N
    assert p == {"t_over_c": 0.8, "baseline": 2000.0, "pipelined": 300.0, "bound": 1.5 * 2500.0 / 12}
    no_inproc = sweep_result() | {"rows": [r for r in sweep_result()["rows"] if r["mode"] != "inproc"]}
    assert link_points(no_inproc, "pipelined") is None


def test_kind_of_each_result() -> None:
    assert kind_of(engine_report()) is ResultKind.ENGINE
    assert kind_of(transfer_report()) is ResultKind.TRANSFER
    assert kind_of(transfer_report(tp=True)) is ResultKind.TRANSFER
    assert kind_of(accuracy_result()) is ResultKind.ACCURACY
    assert kind_of(sweep_result()) is ResultKind.SERVE_SWEEP
    assert kind_of(sweep_result(compare=True)) is ResultKind.SERVE_COMPARE
    assert kind_of({"url": "http://x", "workload": {}, "summary": {}}) is ResultKind.SERVE_RUN
    with pytest.raises(ValueError, match="not a kvpipe benchmark result"):
        kind_of({"something": 1})


def test_plot_files_refuses_what_it_cannot_draw(tmp_path: Path) -> None:
    def write(name: str, data: Any) -> Path:
        (tmp_path / name).write_text(json.dumps(data))
        return tmp_path / name

    eng, acc = write("e.json", engine_report()), write("a.json", accuracy_result())
    with pytest.raises(ValueError, match="one kind per plot"):
        plot_files([eng, acc], tmp_path / "x.png")
    with pytest.raises(ValueError, match="one result per plot"):
        plot_files([acc, acc], tmp_path / "x.png")
    single = write("run.json", {"url": "u", "workload": {}, "summary": {}})
    with pytest.raises(ValueError, match="per-request latencies"):
        plot_files([single], tmp_path / "x.png")
    with pytest.raises(ValueError, match="JSON object"):
        plot_files([write("l.json", [1, 2])], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    # a file of runs gives each run
    both = write("runs.json", {"runs": [engine_report(), engine_report("w4a16")]})
    assert len(load_results([both])) == 2
    assert_png(plot_files([both], tmp_path / "runs.png"))


@pytest.mark.parametrize(
    "files",
    [
        ["engine_llamacpp_smollm2_s12_amd.json"],
        ["transfer_pieces_loopback_a.json"],
        ["kv_accuracy_smollm2.json"],
        ["prefix_decode_cache.json"],
        ["layer_pipelining_issue34_s11_amd_after.json"],
    ],
)
def test_bench_plot_redraws_recorded_results(tmp_path: Path, files: list[str]) -> None:
    out = tmp_path / "recorded.png"
    assert cli.main(["bench", "plot", *(str(DOCS_BENCH / f) for f in files), "--out", str(out)]) == 0
    assert_png(out)


def test_plot_flag_writes_json_and_png(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_output_args(p)
    args = p.parse_args(["--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "sub" / "r.png")])
    write_outputs(accuracy_result(), args, plot_accuracy)
    assert json.loads((tmp_path / "r.json").read_text()) == accuracy_result()
    assert_png(tmp_path / "sub" / "r.png")
