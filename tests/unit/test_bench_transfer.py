"""Bookkeeping of the transfer benchmark (no processes, no timing): fragmented page layouts, flags."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from kvpipe.bench.transfer import add_args, config_from_args
from kvpipe.bench.transfer_worker import fragmented_pages
from kvpipe.transfer.planner import page_runs


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 1.0])
def test_fragmented_pages_have_the_requested_runs(fraction):
    rng = np.random.default_rng(1)
    n = 500
    pages = fragmented_pages(n, fraction, rng)
    assert pages.size == n and np.unique(pages).size == n
    assert pages.min() >= 0 and pages.max() < 2 * n
    _, _, runs = page_runs(np.arange(n), pages)
    if fraction == 0.0:
        assert runs.size == 1 and (pages == np.arange(n)).all()
    elif fraction == 1.0:
        assert runs.size == n
    else:
        assert abs(runs.size - fraction * n) < 4 * np.sqrt(n)


def test_flags_to_worker_config():
    p = argparse.ArgumentParser()
    add_args(p)
    cfg = config_from_args(p.parse_args(["--preset", "bench", "--prompt-lens", "100,33", "--page-size", "16",
                                         "--layers", "3"]), "/tmp/x.log")
    assert (cfg.num_layers, cfg.kv_heads, cfg.head_dim, cfg.dtype) == (3, 4, 64, "float32")
    assert cfg.prompt_lens == (100, 33) and cfg.max_pages == 7 and cfg.pool_pages == 7
    cfg = config_from_args(p.parse_args(["--preset", "llama3-8b", "--fragmentation", "0.5"]), "/tmp/x.log")
    assert cfg.dtype == "bfloat16" and cfg.pool_pages == 2 * cfg.max_pages
    for bad in (["--prompt-lens", "0"], ["--fragmentation", "2"], ["--preset", "nope"]):
        with pytest.raises(SystemExit):
            config_from_args(p.parse_args(bad), "/tmp/x.log")
