"""Tensor parallelism: tp=2 and tp=4 (more ranks than KV heads) give the logits and greedy tokens
of tp=1, and each rank's KV pool holds exactly its slice of the KV heads."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

from model_utils import greedy_generate, incremental_logits, make_pool  # noqa: E402
from test_model_hf_parity import hf_model, save  # noqa: E402

from kvpipe.config import ConfigError, ParallelConfig  # noqa: E402
from kvpipe.model.loader import load_model  # noqa: E402

PAGE = 4
IDS = list(range(3, 23))  # 20 tokens: 13 prompt (prefilled in chunks of 5) + 7 decode steps
TABLE = torch.tensor([4, 0, 5, 2, 1])
GREEDY = 32  # tokens generated greedily after IDS[:10]


def _run(model_dir: Path, parallel: ParallelConfig) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    model = load_model(model_dir, parallel)
    pool = make_pool(model, 6, PAGE)
    logits = incremental_logits(model, IDS, prompt_len=13, page_size=PAGE, chunk=5, page_table=TABLE, pool=pool)
    greedy = greedy_generate(model, IDS[:10], GREEDY, page_size=PAGE)
    return logits, [torch.stack([pool.k[i], pool.v[i]]) for i in range(model.num_layers)], greedy


def _worker(rank: int, world: int, init_file: str, dirs: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", world_size=world, rank=rank)
    for name, d in dirs.items():
        logits, kv, greedy = _run(Path(d), ParallelConfig(world, rank))
        torch.save({"logits": logits, "kv": kv, "greedy": greedy}, Path(out) / f"{name}-{rank}.pt")
    dist.barrier()  # every rank's results are on disk
    # Skip interpreter teardown (as kvpipe's TP workers do): gloo's threads, torn down at exit,
    # sometimes abort the process ("terminate called without an active exception") after the
    # work is done, which mp.spawn reports as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_models")
    return {
        "tiny_llama": str(tiny_model_dir),  # 4 heads, 2 KV heads
        "qwen2_bias": str(save(hf_model("qwen2", num_key_value_heads=2), root / "qwen2")),
        "qwen3_1kv": str(save(hf_model("qwen3", num_key_value_heads=1, head_dim=24), root / "qwen3")),
        # experts sliced by their intermediate dim; renormalised top-k; a dense layer in between
        "qwen3_moe": str(
            save(
                hf_model("qwen3_moe", num_key_value_heads=2, norm_topk_prob=True, mlp_only_layers=[1]),
                root / "qwen3_moe",
            )
        ),
        # q/k norms over all heads: at tp=4 each of the 2 KV heads sits on two ranks
        "minimax_m2": str(
            save(hf_model("minimax_m2", num_key_value_heads=2, head_dim=24, rotary_dim=8), root / "minimax_m2")
        ),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_tp1(world, model_dirs, tmp_path):
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), model_dirs, str(tmp_path)), nprocs=world, join=True)
    for name, d in model_dirs.items():
        want_logits, want_kv, want_greedy = _run(Path(d), ParallelConfig())
        num_kv = load_model(d).cfg.num_kv_heads
        for rank in range(world):
            got = torch.load(tmp_path / f"{name}-{rank}.pt")
            assert got["greedy"] == want_greedy, f"{name} rank {rank}"
            torch.testing.assert_close(got["logits"], want_logits, atol=1e-5, rtol=0, msg=f"{name} rank {rank}")
            par = ParallelConfig(world, rank)
            h0, n = par.kv_head_start(num_kv), par.local_kv_heads(num_kv)
            for layer, (g, w) in enumerate(zip(got["kv"], want_kv)):
                # [2, pages, heads, page, dim]: this rank's heads only
                assert g.shape[2] == n
                torch.testing.assert_close(g, w[:, :, h0 : h0 + n], atol=1e-5, rtol=0, msg=f"{name} L{layer} r{rank}")


def test_tp_rejects_indivisible_split(tiny_model_dir):
    with pytest.raises(ConfigError, match="tp_size=3"):
        load_model(tiny_model_dir, ParallelConfig(3, 0))
    with pytest.raises(ConfigError, match="tp_rank"):
        load_model(tiny_model_dir, ParallelConfig(2, 2))
    with pytest.raises(ConfigError, match="torch.distributed"):
        load_model(tiny_model_dir, ParallelConfig(2, 0))  # no process group in this process
