"""The report of `kvpipe bench transfer`: the prefill's per-length results summed up over the
lengths with the run's config, and printed as tables (same TP; heterogeneous TP)."""

from __future__ import annotations

import statistics
from typing import Any

from kvpipe.bench.transfer.config import TPConfig, WorkerConfig
from kvpipe.bench.transfer.raw_mooncake import WHOLE, fmt_bytes


def summarize(result: dict[str, Any], cfg: WorkerConfig, link_rate: str | None) -> dict[str, Any]:
    lengths = result["lengths"]
    total = sum(x["bytes"] for x in lengths)
    kv_s = sum(x["transfer_ms"] for x in lengths) / 1e3
    raw_s = sum(x["raw_ms"] for x in lengths) / 1e3
    best_s = sum(x["best_raw_ms"] for x in lengths) / 1e3
    return {
        "goodput_gbps": total / kv_s / 1e9,  # over all lengths: sum of bytes / sum of median times
        "raw_goodput_gbps": total / raw_s / 1e9,  # one raw op of all the bytes
        "best_raw_goodput_gbps": total / best_s / 1e9,  # each length's fastest raw pattern
        "goodput_ratio": raw_s / kv_s,
        "best_raw_ratio": best_s / kv_s,  # kvpipe / best raw
        "best_raw_ratio_paired": statistics.median(x["best_raw_ratio_paired"] for x in lengths),
        "ops_per_request": statistics.mean(x["ops_per_request"] for x in lengths),
        "pieces_per_request": statistics.mean(x["pieces_per_request"] for x in lengths),
        "planning_ms": statistics.median(x["planning_ms"] for x in lengths),
        "verified": all(x["verified"] for x in lengths),
        "lengths": lengths,
        "config": {
            "layers": cfg.num_layers,
            "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "latent": cfg.latent,
            "dtype": cfg.dtype,
            "page_size": cfg.page_size,
            "repeat": cfg.repeat,
            "fragmentation": cfg.fragmentation,
            "window": cfg.window,
            "max_op_bytes": cfg.max_op_bytes,
            "raw_patterns": [p.label for p in cfg.raw_patterns],
            "compare_max_op_bytes": list(cfg.compare_max_op_bytes),
            "protocol": "tcp",
            "link_rate": link_rate or "loopback",
            "engine_generation": result["engine_generation"],
            **_hybrid_config(cfg),
            **_sliding_config(cfg),
        },
    }


def _sliding_config(cfg: WorkerConfig) -> dict[str, Any]:
    """A sliding-window shape's layer map and window, for the report (nothing otherwise)."""
    if not cfg.sliding_layers:
        return {}
    return {"sliding_layers": list(cfg.sliding_layers), "sliding_window": cfg.sliding_window}


def _hybrid_config(cfg: WorkerConfig) -> dict[str, Any]:
    """A hybrid shape's layer map and state size, for the report (nothing for a KV-only shape)."""
    h = cfg.hybrid
    if h is None:
        return {}
    return {
        "model_layers": len(h.layer_types),
        "kv_layers": list(h.full_layers),
        "linear_layers": len(h.linear_layers),
        "linear_key_heads": h.linear_key_heads,
        "linear_value_heads": h.linear_value_heads,
        "linear_key_head_dim": h.linear_key_head_dim,
        "linear_value_head_dim": h.linear_value_head_dim,
        "conv_kernel": h.conv_kernel,
    }


def format_table(report: dict[str, Any], sweep: bool = False) -> str:
    c = report["config"]
    split = fmt_bytes(c["max_op_bytes"]) if c["max_op_bytes"] else "off"
    kind = "MLA latent" if c.get("latent") else "KV"
    hybrid = "model_layers" in c
    if hybrid:
        kind = (
            f"hybrid {c['model_layers']}L: state of {c['linear_layers']} linear layers ({c['linear_value_heads']} "
            f"value heads, {c['linear_key_head_dim']}x{c['linear_value_head_dim']}) + KV of"
        )
    rows = [
        f"{kind} {c['layers']}L x {c['kv_heads']}H x {c['head_dim']}D {c['dtype']}, page {c['page_size']}, "
        f"fragmentation {c['fragmentation']}, link {c['link_rate']}, window {c['window']}, split {split}, "
        f"median of {c['repeat']}; GB/s; paired: median of per-round kvpipe/best-raw"
    ]
    if hybrid:  # a request's bytes and ops split into KV and state; the goodput table counts both
        rows.append(f"{'tokens':>7} {'KV MiB':>8} {'state MiB':>9} {'KV ops':>6} {'state ops':>9}")
        rows += [
            f"{x['prompt_len']:>7} {x['kv_bytes'] / 2**20:>8.1f} {x['state_bytes'] / 2**20:>9.1f} "
            f"{x['kv_ops']:>6} {x['state_ops']:>9}"
            for x in report["lengths"]
        ]
    if "sliding_window" in c:  # the window pages against a bench of every page of every layer
        rows[0] = (
            f"{len(c['sliding_layers'])} of {c['layers']} layers sliding (window {c['sliding_window']}), " + rows[0]
        )
        rows.append(f"{'tokens':>7} {'KV MiB':>8} {'all pages MiB':>13} {'ratio':>6} {'window pages':>12}")
        rows += [
            f"{x['prompt_len']:>7} {x['kv_bytes'] / 2**20:>8.1f} {x['all_pages_bytes'] / 2**20:>13.1f} "
            f"{x['window_ratio']:>6.3f} {x['window_pages']:>12}"
            for x in report["lengths"]
        ]
    rows.append(
        f"{'tokens':>7} {'MiB':>8} {'ops':>5} {'pieces':>6} {'plan ms':>8} {'xfer ms':>8} {'kvpipe':>7} "
        f"{'unsplit':>7} {'raw 1op':>7} {'best raw':>8} {'pattern':>10} {'kv/best':>7} {'paired':>6} "
        f"{'kv/1op':>6} ok"
    )
    for x in report["lengths"]:
        rows.append(
            f"{x['prompt_len']:>7} {x['bytes'] / 2**20:>8.1f} {x['ops_per_request']:>5} "
            f"{x['pieces_per_request']:>6} {x['planning_ms']:>8.3f} {x['transfer_ms']:>8.2f} "
            f"{x['goodput_gbps']:>7.2f} {_gbps(x['unsplit_goodput_gbps']):>7} {x['raw_goodput_gbps']:>7.2f} "
            f"{x['best_raw_goodput_gbps']:>8.2f} {x['best_raw']['label']:>10} {x['best_raw_ratio']:>7.2f} "
            f"{x['best_raw_ratio_paired']:>6.2f} "
            f"{x['goodput_ratio']:>6.2f} {'yes' if x['verified'] else 'NO'}"
        )
    rows.append(
        f"overall goodput {report['goodput_gbps']:.2f} GB/s vs best raw {report['best_raw_goodput_gbps']:.2f} "
        f"(ratio {report['best_raw_ratio']:.2f}), vs one raw op {report['raw_goodput_gbps']:.2f} "
        f"(ratio {report['goodput_ratio']:.2f})"
    )
    if len(c["compare_max_op_bytes"]) > 1:
        rows += [
            f"kvpipe split at (GB/s), {x['prompt_len']} tokens: "
            + ", ".join(
                f"{fmt_bytes(s['max_op_bytes']) if s['max_op_bytes'] else 'off'} {s['goodput_gbps']:.2f}"
                for s in x["split_compare"]
            )
            for x in report["lengths"]
        ]
    if sweep:
        rows += [""] + [format_sweep(x) for x in report["lengths"]]
    return "\n".join(rows)


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_sweep(length: dict[str, Any]) -> str:
    """One length's raw sweep as a grid: piece size (rows) x window (columns) -> median GB/s."""
    cells = {(s["piece_bytes"], s["window"]): s["goodput_gbps"] for s in length["sweep"] if s["piece_bytes"] != WHOLE}
    one_op = next((s["goodput_gbps"] for s in length["sweep"] if s["piece_bytes"] == WHOLE), float("nan"))
    pieces = sorted({p for p, _ in cells})
    windows = sorted({w for _, w in cells})
    rows = [
        f"raw sweep, {length['prompt_len']} tokens ({length['bytes'] / 2**20:.1f} MiB), GB/s: piece \\ window "
        f"(one op: {one_op:.2f}; best: {length['best_raw']['label']})",
        f"{'piece':>6} " + " ".join(f"{w:>6}" for w in windows),
    ]
    for p in pieces:
        rows.append(
            f"{fmt_bytes(p):>6} " + " ".join(f"{cells[p, w]:>6.2f}" if (p, w) in cells else f"{'':>6}" for w in windows)
        )
    return "\n".join(rows)


def summarize_tp(result: dict[str, Any], cfg: TPConfig, link_rate: str | None) -> dict[str, Any]:
    lengths = result["lengths"]
    return {
        "mode": "tp",
        "lengths": lengths,
        "verified": all(x["verified"] and x["equal_bytes"] for x in lengths),
        "config": {
            "layers": cfg.num_layers,
            "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "dtype": cfg.dtype,
            "page_size": cfg.page_size,
            "repeat": cfg.repeat,
            "fragmentation": cfg.fragmentation,
            "window": cfg.window,
            "prefill_tp": cfg.prefill_tp,
            "decode_tp": cfg.decode_tp,
            "staging": cfg.staging,
            "staging_pool_mb": cfg.staging_pool_mb,
            "link_rate": link_rate or "loopback",
        },
    }


def format_tp_table(report: dict[str, Any]) -> str:
    c = report["config"]
    rows = [
        f"TP {c['prefill_tp']} -> {c['decode_tp']}, KV {c['layers']}L x {c['kv_heads']}H x {c['head_dim']}D "
        f"{c['dtype']}, page {c['page_size']}, fragmentation {c['fragmentation']}, staging {c['staging']} "
        f"({c['staging_pool_mb']} MB), link {c['link_rate']}, median of {c['repeat']}",
        f"{'tokens':>7} {'MiB':>7} {'same ms':>8} {'plain ms':>9} {'staged ms':>10} {'same ops':>9} "
        f"{'plain ops':>10} {'staged ops':>11} {'staged/same':>12} {'ops /':>6} ok",
    ]
    for x in report["lengths"]:
        rows.append(
            f"{x['prompt_len']:>7} {x['bytes'] / 2**20:>7.1f} {x['same_ms']:>8.2f} {x['plain_ms']:>9.2f} "
            f"{x['staged_ms']:>10.2f} {x['same_ops']:>9} {x['plain_ops']:>10} {x['staged_ops']:>11} "
            f"{x['staged_vs_same']:>12.2f} {x['op_reduction']:>6.1f} "
            f"{'yes' if x['verified'] and x['equal_bytes'] else 'NO'}"
        )
    return "\n".join(rows)
