"""PNG plot of `kvpipe bench kv-accuracy` and `kvpipe bench quant-accuracy` results: per variant
(KV dtype or quantization) the greedy token agreement and the share of prompts answered
identically, and the logprob drift over the agreeing positions."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpipe.bench.plotting import grouped_bars, pyplot, save

VARIANT_KEYS = ("kv_cache_dtype", "quantization")  # what a row varies, by benchmark


def variant_key(result: Mapping[str, Any]) -> str:
    """The row key naming each variant: kv_cache_dtype (kv-accuracy) or quantization."""
    rows = result.get("rows") or [{}]
    for key in VARIANT_KEYS:
        if key in rows[0]:
            return key
    raise ValueError(f"an accuracy result's rows name one of {VARIANT_KEYS}")


def plot_accuracy(result: Mapping[str, Any], path: str | Path) -> Path:
    """Agreement and drift panels of one result (see the module doc)."""
    plt = pyplot()
    key = variant_key(result)
    rows = result["rows"]
    labels = [str(r[key]) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    grouped_bars(
        ax1,
        labels,
        {
            "token agreement": [r["token_agreement"] for r in rows],
            "prompts identical": [r["prompts_identical"] / r["prompts"] for r in rows],
        },
        "fraction (1.0 = the reference's tokens)",
        "greedy agreement",
        fmt="{:.2f}",
    )
    ax1.set_ylim(0, 1.12)
    grouped_bars(
        ax2,
        labels,
        {
            "mean |logprob diff|": [r["mean_abs_logprob_diff"] for r in rows],
            "max |logprob diff|": [r["max_abs_logprob_diff"] for r in rows],
        },
        "nats, over the agreeing positions",
        "logprob drift",
        fmt="{:.1e}",
        log=True,
    )
    c = result["config"]
    fig.suptitle(
        f"{Path(str(c.get('model_path', '?'))).name}: {c['num_prompts']} prompts x {c['output_len']} greedy tokens "
        f"against {c.get('reference', 'the reference')}",
        fontsize=10,
    )
    return save(plt, fig, path)
