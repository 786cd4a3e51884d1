"""The floor bookkeeping of `kvpipe bench engine` (bench/engine/floor.py): bytes a decode step
reads and FLOPs a prefill runs, from a model's config, dtype and quantization; no timing."""

from __future__ import annotations

import pytest

from kvpipe.bench.engine.floor import (
    Peaks,
    decode_floor_fields,
    decode_matrices,
    kv_bytes_per_step,
    prefill_floor_fields,
    prefill_flops,
    weight_bytes,
)
from kvpipe.bench.engine.stats import compare_dtype_decode, compare_dtype_prefill, format_table
from kvpipe.model.registry import model_config

# SmolLM2-135M's shape: 30 layers, hidden 576, 9 heads of 64, 3 KV heads, MLP 1536, vocab 49152, tied
SMOL = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
# per layer: q 576x576, k and v 192x576, o 576x576, gate and up 1536x576, down 576x1536
LAYER = 576 * 576 * 2 + 192 * 576 * 2 + 1536 * 576 * 3
HEAD = 49152 * 576


def test_dense_weights_per_step_by_dtype_and_quantization():
    cfg = model_config(SMOL)
    mats = decode_matrices(cfg)
    assert mats is not None and sum(m.numel for m in mats) == 30 * LAYER + HEAD  # 134.5M: the model less norms
    assert weight_bytes(cfg, "float32", None) == 4 * (30 * LAYER + HEAD)
    assert weight_bytes(cfg, "bfloat16", None) == 2 * (30 * LAYER + HEAD)
    rows = 30 * (576 * 2 + 192 * 2 + 1536 * 2 + 576)  # output rows of the projections (one scale each)
    groups = 30 * (576 * 576 / 32 * 2 + 192 * 576 / 32 * 2 + 1536 * 576 / 32 * 2 + 576 * 1536 / 32)
    head8 = HEAD + 4 * 49152  # the logits' projection stays int8 with row scales in both modes
    assert weight_bytes(cfg, "float32", "w8a16") == 30 * LAYER + 4 * rows + head8
    assert weight_bytes(cfg, "float32", "w4a16") == 30 * LAYER / 2 + 8 * groups + head8


def test_moe_counts_the_experts_a_token_reads():
    raw = dict(SMOL, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=2, head_dim=64)
    raw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)
    cfg = model_config(raw)
    attn = 576 * 576 * 2 + 192 * 576 * 2
    experts = 2 * 256 * 576 * 3  # top-2 of 8 experts, gate, up and down each
    assert weight_bytes(cfg, "bfloat16", None) == 2 * (2 * (attn + 8 * 576 + experts) + HEAD)


def test_kv_bytes_and_prefill_flops():
    cfg = model_config(SMOL)
    assert kv_bytes_per_step(cfg, batch=4, context=100, kv_dtype="bfloat16") == 4 * 30 * 2 * 3 * 64 * 100 * 2
    assert kv_bytes_per_step(cfg, batch=1, context=10, kv_dtype="float8_e4m3fn") == 30 * 2 * 3 * 64 * 10
    dense = 2 * (30 * LAYER + HEAD)
    attn = 4 * 9 * 64 * 30  # per (query, key) pair, over all layers
    assert prefill_flops(cfg, 1) == dense + attn
    assert prefill_flops(cfg, 512, batch=2) == 2 * (512 * dense + attn * 512 * 513 / 2)


def test_floor_fields_and_their_columns():
    cfg = model_config(SMOL)
    peaks = Peaks(bandwidth=20e9, flops=0.5e12, dtype="bfloat16")
    prow = prefill_floor_fields({"prompt_len": 512, "batch": 1, "ms_per_prefill": 1000.0}, cfg, peaks)
    assert prow["floor_ms"] == pytest.approx(1000 * prefill_flops(cfg, 512) / 0.5e12)
    assert prow["x_floor"] == pytest.approx(1000.0 / prow["floor_ms"])
    drow = {"batch": 1, "context": 250, "warmup_steps": 4, "steps": 12, "ms_per_step": 40.0}
    d = decode_floor_fields(drow, cfg, peaks, "bfloat16", None, "bfloat16")
    assert d["kv_bytes"] == kv_bytes_per_step(cfg, 1, 260, "bfloat16")  # mean context of the timed steps
    assert d["floor_ms"] == pytest.approx(1000 * (2 * (30 * LAYER + HEAD) + d["kv_bytes"]) / 20e9)
    assert d["x_floor"] == pytest.approx(40.0 / d["floor_ms"])


def test_families_not_counted_have_no_floor():
    raw = dict(SMOL, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    raw.update(
        q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4
    )
    raw.update(num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1, n_group=1, topk_group=1)
    cfg = model_config(raw)
    assert cfg.mla is not None and weight_bytes(cfg, "float32", None) is None and prefill_flops(cfg, 8) is None
    peaks = Peaks(bandwidth=1e9, flops=1e9, dtype="float32")
    row = prefill_floor_fields({"prompt_len": 8, "batch": 1, "ms_per_prefill": 5.0}, cfg, peaks)
    assert row["floor_ms"] is None and row["x_floor"] is None


def test_table_shows_floor_columns_and_rates():
    config = dict(model="m", tp_size=1, page_size=64, chunked_prefill_size=8192, repeat=1, warmup=0)
    config.update(decode_context=8, output_len=4, decode_warmup_steps=0)
    pre = dict(prompt_len=8, batch=1, ms_per_prefill=2.0, tokens_per_s=4e3, steps=1, cpu_per_wall=1.9)
    report = {
        "machine": {"torch": "2", "threads": 2, "cpu": "cpu"},
        "config": config,
        "peaks": {"bandwidth_gb_s": 21.5, "matmul_tflop_s": 0.9, "dtype": "bfloat16"},
        "prefill": [pre],
        "decode": [],
    }
    report["prefill"][0].update(floor_ms=0.5, x_floor=4.0)
    dec = dict(batch=1, ms_per_step=3.0, tokens_per_s=333.0, ms_per_step_p50=3.0, ms_per_step_max=3.1)
    dec.update(cpu_per_wall=1.9, weight_bytes=2e6, kv_bytes=1e6, floor_ms=1.5, x_floor=2.0)
    report["decode"] = [dec]
    text = format_table(report)
    assert "x floor" in text and "4.00" in text and "2.00" in text and "3.00" in text  # MB read: 3.00
    assert "21.5 GB/s" in text and "0.900 TFLOP/s bfloat16" in text


def test_compare_dtype_ratios_and_columns():
    prefill = dict(prompt_len=8, batch=1, ms_per_prefill=2.0, tokens_per_s=4e3, steps=1, cpu_per_wall=1.9)
    row = compare_dtype_prefill(prefill, {**prefill, "ms_per_prefill": 4.0}, "float32")
    assert row["time_ratio_vs_dtype"] == 0.5 and row["other_dtype"]["dtype"] == "float32"
    dec = dict(batch=1, ms_per_step=3.0, tokens_per_s=333.0, ms_per_step_p50=3.0, ms_per_step_max=3.1, cpu_per_wall=1.9)
    drow = compare_dtype_decode(dec, {**dec, "ms_per_step": 2.0}, "float32")
    assert drow["step_ratio_vs_dtype"] == 1.5
    config = dict(model="m", tp_size=1, page_size=64, chunked_prefill_size=8192, repeat=1, warmup=0)
    config.update(decode_context=8, output_len=4, decode_warmup_steps=0, run_dtype="bfloat16", compare_dtype="float32")
    machine = {"torch": "2", "threads": 2, "cpu": "c"}
    text = format_table({"machine": machine, "config": config, "prefill": [row], "decode": [drow]})
    assert "float32 ms" in text and "0.50" in text and "1.50" in text and "dtype bfloat16" in text


def test_peaks_keep_the_better_of_two_measurements():
    a, b = Peaks(10e9, 1e12, "bfloat16"), Peaks(20e9, 0.5e12, "bfloat16")
    assert a.best(b) == Peaks(20e9, 1e12, "bfloat16") == b.best(a)
    with pytest.raises(ValueError):
        a.best(Peaks(1.0, 1.0, "float32"))
