"""Sweep bookkeeping without servers: modes, the loop, rows, exposed-transfer ratios, probes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvpipe.bench.kv_bytes import ServedDtypes, kv_wire_bytes, state_bytes_per_request, with_draft_kv
from kvpipe.bench.serve.plot import plot_modes, plot_run, plot_sweep
from kvpipe.bench.serve.sweep import (
    ModeFlags,
    SweepPoint,
    mode_server_flags,
    parse_modes,
    parse_prompt_lens,
    run_sweep,
    server_flag,
    server_page_size,
)
from kvpipe.bench.serve.sweep_rows import exposed_ratio, sweep_rows
from kvpipe.harness.latency import summarize
from kvpipe.harness.outcome import End, Outcome
from kvpipe.harness.probe import num_groups_from_metrics, num_groups_from_server_info
from kvpipe.harness.request import Request
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.presets import preset_config
from kvpipe.model.registry import model_config
from kvpipe.transfer.planning.wire_bytes import KVWireBytes
from tests.helpers.sweep_stacks import recording_stacks


def s(ttft50: float | None, ttft99: float | None = None, tpot50: float | None = 5.0) -> dict:
    return {
        "ttft_p50_ms": ttft50,
        "ttft_p99_ms": ttft99 if ttft99 is not None else ttft50,
        "tpot_p50_ms": tpot50,
        "completed": 4,
        "failed": 0,
    }


def test_parse_modes_and_flags() -> None:
    assert parse_modes("baseline, pipelined,inproc") == ["baseline", "pipelined", "inproc"]
    assert parse_modes("pipelined-4") == ["pipelined-4"]
    for bad in ("", "baseline,baseline", "fast", "pipelined-0", "pipelined-x"):
        with pytest.raises(ValueError):
            parse_modes(bad)
    assert parse_modes("decode-cache,baseline") == ["decode-cache", "baseline"]
    assert mode_server_flags("baseline") == ModeFlags(("--disaggregation-layer-groups", "1"))
    assert mode_server_flags("pipelined") == ModeFlags(("--disaggregation-layer-groups", "auto"))
    assert mode_server_flags("pipelined-3") == ModeFlags(("--disaggregation-layer-groups", "3"))
    # the decode cache flag goes to the decode only (a prefill refuses it)
    assert mode_server_flags("decode-cache") == ModeFlags(
        ("--disaggregation-layer-groups", "1"), ("--disaggregation-enable-decode-radix-cache",)
    )
    assert mode_server_flags("pd-nocache") == ModeFlags(
        ("--disaggregation-layer-groups", "1", "--disable-radix-cache")
    )  # both servers: no prefix cache anywhere
    assert mode_server_flags("inproc") is None
    assert parse_prompt_lens("256,1024") == [256, 1024]
    for bad in ("", "0", "a,b"):
        with pytest.raises(ValueError):
            parse_prompt_lens(bad)


def test_exposed_ratio() -> None:
    assert exposed_ratio(130.0, 200.0, 100.0) == pytest.approx(0.3)
    assert exposed_ratio(90.0, 200.0, 100.0) == pytest.approx(-0.1)  # noise can go below the reference
    assert exposed_ratio(None, 200.0, 100.0) is None
    assert exposed_ratio(130.0, None, 100.0) is None
    assert exposed_ratio(130.0, 200.0, None) is None
    assert exposed_ratio(130.0, 100.0, 100.0) is None  # nothing exposed by the baseline: undefined


def test_rows_order_ratio_and_fields() -> None:
    points = [
        SweepPoint(1024, "baseline", s(300.0, 320.0), 1),
        SweepPoint(256, "baseline", s(60.0), 1),
        SweepPoint(1024, "pipelined", s(150.0, 170.0, 6.0), 4),
        SweepPoint(256, "pipelined", s(61.0), 1),
        SweepPoint(1024, "inproc", s(100.0), None),
        SweepPoint(256, "inproc", s(50.0), None),
    ]
    rows = sweep_rows(points, link_rate_bps=1e9, kv_wire=KVWireBytes(1000))
    assert [(r["prompt_len"], r["mode"]) for r in rows] == [
        (256, "baseline"),
        (256, "pipelined"),
        (256, "inproc"),
        (1024, "baseline"),
        (1024, "pipelined"),
        (1024, "inproc"),
    ]
    by = {(r["prompt_len"], r["mode"]): r for r in rows}
    p = by[(1024, "pipelined")]
    assert (p["ttft_p50_ms"], p["ttft_p99_ms"], p["tpot_p50_ms"], p["num_groups"]) == (150.0, 170.0, 6.0, 4)
    assert p["exposed_transfer_ms"] == pytest.approx(50.0)
    assert p["exposed_transfer_ratio"] == pytest.approx(0.25)  # (150-100)/(300-100)
    assert p["ttft_vs_baseline"] == pytest.approx(-0.5)
    assert by[(256, "pipelined")]["exposed_transfer_ratio"] == pytest.approx(1.1)
    assert by[(1024, "baseline")]["exposed_transfer_ratio"] is None
    assert by[(1024, "baseline")]["exposed_transfer_ms"] == pytest.approx(200.0)
    assert by[(1024, "inproc")]["exposed_transfer_ms"] is None
    # KV of 1024 tokens * 1000 B at 1 Gbit/s = 8.192 ms; C = inproc TTFT = 100 ms.
    assert p["kv_bytes"] == 1_024_000 and p["ideal_transfer_ms"] == pytest.approx(8.192)
    assert p["t_over_c"] == pytest.approx(0.08192)
    for r in rows:
        assert {
            "prompt_len",
            "mode",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "num_groups",
            "exposed_transfer_ratio",
        } <= r.keys()


def test_rows_without_reference_or_link() -> None:
    rows = sweep_rows([SweepPoint(512, "pipelined-2", s(80.0), 2), SweepPoint(512, "baseline", s(100.0), 1)])
    assert [r["mode"] for r in rows] == ["pipelined-2", "baseline"]
    assert all(r["exposed_transfer_ratio"] is None and r["exposed_transfer_ms"] is None for r in rows)
    assert rows[0]["ttft_vs_baseline"] == pytest.approx(-0.2)
    assert rows[0]["ideal_transfer_ms"] is None and rows[0]["t_over_c"] is None
    failed = sweep_rows(
        [
            SweepPoint(512, "pipelined", s(None), None),
            SweepPoint(512, "baseline", s(100.0)),
            SweepPoint(512, "inproc", s(50.0)),
        ]
    )
    assert failed[0]["exposed_transfer_ratio"] is None and failed[0]["ttft_vs_baseline"] is None


def test_run_sweep_one_stack_per_mode_every_length() -> None:
    events: list[tuple] = []

    open_stack = recording_stacks(events)

    def measure(ep: str, mode: str, n: int) -> tuple[dict, int | None]:
        events.append(("measure", ep, n))
        return s(float(n)), (4 if mode == "pipelined" else None)

    points = run_sweep([256, 1024], ["baseline", "pipelined"], open_stack, measure)
    assert events == [
        ("start", "baseline"),
        ("measure", "url-baseline", 256),
        ("measure", "url-baseline", 1024),
        ("stop", "baseline"),
        ("start", "pipelined"),
        ("measure", "url-pipelined", 256),
        ("measure", "url-pipelined", 1024),
        ("stop", "pipelined"),
    ]
    assert [(p.prompt_len, p.mode, p.num_groups) for p in points] == [
        (256, "baseline", None),
        (1024, "baseline", None),
        (256, "pipelined", 4),
        (1024, "pipelined", 4),
    ]


def test_run_sweep_stops_the_stack_when_measuring_fails() -> None:
    stopped = []

    @contextlib.contextmanager
    def open_stack(mode: str) -> Iterator[str]:
        try:
            yield mode
        finally:
            stopped.append(mode)

    def measure(ep: str, mode: str, n: int) -> tuple[dict, int | None]:
        raise RuntimeError("server died")

    with pytest.raises(RuntimeError):
        run_sweep([256], ["baseline", "inproc"], open_stack, measure)
    assert stopped == ["baseline"]


def _model(arch: str, **cfg: object) -> ModelConfig:
    """A checkpoint schema from an HF config.json's fields (plus what every family needs)."""
    base = {"architectures": [arch], "vocab_size": 1000, "intermediate_size": 1024, "hidden_size": 768}
    return model_config({**base, **cfg})


BENCH = {
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "torch_dtype": "float32",
}


def test_kv_bytes_per_token() -> None:
    bench = _model("LlamaForCausalLM", **BENCH)
    assert kv_wire_bytes(bench, 64) == KVWireBytes(2 * 12 * 4 * 64 * 4, page_size=64)
    bf16 = _model("LlamaForCausalLM", **(BENCH | {"torch_dtype": "bfloat16"}))
    assert kv_wire_bytes(bf16, 64) == KVWireBytes(2 * 12 * 4 * 64 * 2, page_size=64)
    mha = _model("LlamaForCausalLM", **(BENCH | {"num_key_value_heads": None, "head_dim": None}))
    assert kv_wire_bytes(mha, 64) == KVWireBytes(2 * 12 * 12 * 64 * 4, page_size=64)
    assert kv_wire_bytes(_model("LlamaForCausalLM", **(BENCH | {"torch_dtype": "int4"})), 64) is None  # unknown size
    mla = preset_config("tiny-deepseek-v3")  # one latent of kv_lora_rank + rope dims per layer, no K/V pair
    assert mla.mla is not None
    assert kv_wire_bytes(mla, 16) == KVWireBytes(
        4 * (mla.mla.kv_lora_rank + mla.mla.qk_rope_head_dim) * 4, page_size=16
    )
    assert state_bytes_per_request(bench) == 0 and state_bytes_per_request(mla) == 0


def test_a_draft_models_kv_adds_to_the_targets() -> None:
    """PD with a STANDALONE draft model moves the draft's KV too: per token its layers x K/V x heads
    x head_dim in its own pool's itemsize; drafts the drafter refuses predict nothing."""
    target = kv_wire_bytes(_model("LlamaForCausalLM", **BENCH), 64, 2)
    draft = _model("LlamaForCausalLM", **(BENCH | {"num_hidden_layers": 2, "num_key_value_heads": 1}))
    assert target is not None
    both = with_draft_kv(target, draft, 4)
    assert both == KVWireBytes(2 * 12 * 4 * 64 * 2 + 2 * 2 * 1 * 64 * 4, page_size=64)
    assert both.request_nbytes(10) == 10 * both.full_token_nbytes
    assert with_draft_kv(target, preset_config("tiny-gpt-oss"), 4) is None


def test_hybrid_and_sliding_bytes_per_token_by_hand() -> None:
    qwen = preset_config("tiny-qwen3.5")  # layers L L L F, fp32
    # KV: the one full-attention layer, K and V of 2 heads x 32
    w = kv_wire_bytes(qwen, 16)
    assert w is not None and w.request_nbytes(1) == 1 * 2 * 2 * 32 * 4 == 512
    # per linear layer: conv [2*4*32 + 8*32 = 512 channels, kernel 4 - 1] fp32 + recurrent [8, 32, 32] fp32
    assert state_bytes_per_request(qwen) == 3 * (512 * 3 * 4 + 8 * 32 * 32 * 4) == 116736
    # GPT-OSS keeps every token of its sliding layers too, but sends them only the last window
    oss = preset_config("tiny-gpt-oss")
    w = kv_wire_bytes(oss, 16)
    assert w is not None and w.all_layers_nbytes(1) == 4 * 2 * 4 * 16 * 4 == 2048 and state_bytes_per_request(oss) == 0
    # transformers' Qwen3_5TextConfig defaults, bf16: 8 of 32 layers keep KV (4 heads x 256);
    # 24 keep conv [8192, 3] bf16 + recurrent [32, 128, 128] fp32
    real = _model(
        "Qwen3_5ForCausalLM",
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        hidden_size=4096,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        dtype="bfloat16",
    )
    w = kv_wire_bytes(real, 64)
    assert w is not None and w.request_nbytes(1) == 8 * 2 * 4 * 256 * 2 == 32768
    assert state_bytes_per_request(real) == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4) == 51511296


def test_sweep_rows_send_the_state_once_per_request() -> None:
    points = [SweepPoint(n, "inproc", s(100.0)) for n in (1000, 2000)]
    rows = sweep_rows(points, link_rate_bps=8e6, kv_wire=KVWireBytes(512), state_bytes_request=116736)
    # 8 Mbit/s = 1,000 bytes per ms
    assert [r["ideal_transfer_ms"] for r in rows] == pytest.approx(
        [(1000 * 512 + 116736) / 1000, (2000 * 512 + 116736) / 1000]
    )
    assert [r["kv_bytes"] for r in rows] == [512000, 1024000] and rows[0]["state_bytes"] == 116736


def test_num_groups_probes() -> None:
    assert num_groups_from_server_info({"internal_states": [{"num_groups": 4}]}) == 4
    assert num_groups_from_server_info({"last_num_groups": 3, "internal_states": [{}]}) == 3
    assert num_groups_from_server_info({"internal_states": [{"num_layer_groups": 0}]}) is None
    assert num_groups_from_server_info({"num_groups": True}) is None
    assert num_groups_from_server_info({"tp_size": 1}) is None
    text = (
        "# HELP kvpipe:num_layer_groups groups of the last prefill batch\n"
        "# TYPE kvpipe:num_layer_groups gauge\n"
        'kvpipe:num_layer_groups{model_name="m"} 6.0\n'
        'kvpipe:layer_groups_bucket{le="4"} 9\n'
        "kvpipe:prompt_tokens_total 100\n"
    )
    assert num_groups_from_metrics(text) == 6
    assert num_groups_from_metrics("kvpipe:num_layer_groups_count 9\nfoo 1\n") is None
    assert num_groups_from_metrics("") is None


def test_plots_write_pngs(tmp_path) -> None:
    points = [
        SweepPoint(n, m, s(t * n / 256, t * n / 200), g)
        for n in (256, 1024, 2048)
        for m, t, g in (("baseline", 60.0, 1), ("pipelined", 40.0, 4), ("inproc", 30.0, None))
    ]
    rows = sweep_rows(points, link_rate_bps=1e9, kv_wire=KVWireBytes(24576))
    out = plot_sweep(rows, tmp_path / "sub" / "sweep.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recs = [
        Outcome(
            Request(i, (1,) * 8, 2),
            End.OK,
            0.0,
            1.0,
            8,
            token_times=(0.1 * (i + 1), 0.1 * (i + 1) + 0.05),
            token_counts=(1, 2),
        )
        for i in range(4)
    ]
    recs.append(Outcome(Request(9, (1,) * 8, 2), End.TIMEOUT, 0.0, 1.0, 8, reason="timeout"))
    run_png = plot_run(recs, summarize(recs, 1.0), tmp_path / "run.png")
    assert run_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    modes = [
        SweepPoint(2176, m, s(t), kv_bytes_per_request=kv)
        for m, t, kv in (("baseline", 4000.0, 5e7), ("decode-cache", 800.0, 4e6), ("inproc", 300.0, None))
    ]
    bars = plot_modes(sweep_rows(modes), tmp_path / "modes.png")
    assert bars.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sliding_window_request_bytes_by_hand() -> None:
    oss = preset_config("tiny-gpt-oss")  # layers 0, 2 sliding (window 32), fp32, 4 KV heads x 16
    w = kv_wire_bytes(oss, page_size=16)
    assert w is not None and (w.full_token_nbytes, w.swa_token_nbytes, w.window) == (1024, 1024, 32)
    # 100 tokens: sliding layers send pages 4..6 of 16 tokens, tokens 64..99
    assert w.request_nbytes(100) == 100 * 1024 + 36 * 1024 == 139264
    # openai/gpt-oss-20b's attention (transformers' GptOssConfig defaults, 24 layers), bf16
    real = _model(
        "GptOssForCausalLM",
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        hidden_size=2880,
        sliding_window=128,
        num_local_experts=32,
        num_experts_per_tok=4,
        torch_dtype="bfloat16",
    )
    w = kv_wire_bytes(real, page_size=64)
    assert w is not None and w.request_nbytes(4096) == (4096 + 128) * 12 * 2048 == 103809024
    # other models: every token of every layer, the sweep's rows unchanged
    w = kv_wire_bytes(_model("LlamaForCausalLM", **BENCH), page_size=64)
    assert w is not None and w.request_nbytes(1000) == 1000 * 2 * 12 * 4 * 64 * 4
    points = [SweepPoint(n, "inproc", s(100.0)) for n in (100, 4096)]
    rows = sweep_rows(points, link_rate_bps=8e6, kv_wire=kv_wire_bytes(oss, 16))
    assert [r["kv_bytes"] for r in rows] == [139264, 4096 * 1024 + 32 * 1024]
    assert rows[0]["ideal_transfer_ms"] == pytest.approx(139264 * 8 / 8e6 * 1e3)
    assert [r["kv_bytes"] for r in sweep_rows(points, 8e6, KVWireBytes(2048))] == [100 * 2048, 4096 * 2048]
    assert [r["kv_bytes"] for r in sweep_rows(points, 8e6)] == [None, None]  # the model's size unknown


def test_server_page_size() -> None:
    assert server_page_size(()) == 64
    assert server_page_size(("--tp", "2", "--page-size", "16")) == 16
    assert server_page_size(("--page-size=32",)) == 32
    assert server_flag(("--kv-cache-dtype", "bfloat16", "--kv-cache-dtype=fp8_e4m3"), "--kv-cache-dtype") == "fp8_e4m3"
    assert server_flag(("--dtype", "float16"), "--kv-cache-dtype") is None


def test_predicted_bytes_follow_the_served_dtypes() -> None:
    """The bench predicts what the servers move with their --dtype and --kv-cache-dtype: a bf16
    checkpoint runs in fp32 on CPU unless --dtype says otherwise, and the pool's element size
    follows --kv-cache-dtype (fp8: 1 byte)."""
    bf16 = _model("LlamaForCausalLM", **(BENCH | {"torch_dtype": "bfloat16"}))
    per_token = 2 * 12 * 4 * 64
    cases = [
        ((None, None, None), ServedDtypes(4, 4)),  # CPU: fp32 whatever the checkpoint
        ((None, None, "cuda"), ServedDtypes(2, 2)),  # elsewhere: the checkpoint's
        (("float16", None, None), ServedDtypes(2, 2)),
        (("auto", "fp8_e4m3", None), ServedDtypes(4, 1)),
        (("bfloat16", "fp8_e5m2", None), ServedDtypes(2, 1)),
    ]
    for (dtype, kv, device), want in cases:
        served = ServedDtypes.of(bf16, dtype, kv, device)
        assert served == want, (dtype, kv, device)
        assert kv_wire_bytes(bf16, 64, served.kv) == KVWireBytes(per_token * want.kv, page_size=64)
    qwen = preset_config("tiny-qwen3.5")  # conv state in the model dtype, recurrent state fp32
    assert state_bytes_per_request(qwen, 2) == 3 * (512 * 3 * 2 + 8 * 32 * 32 * 4)
