"""Qwen3.5 under tensor parallelism (gloo, CPU): tp=2 and tp=4 give the logits and greedy tokens
of tp=1, and each rank's StatePool holds exactly its heads' slice of the recurrent state. The MoE
variant (experts and shared expert split by their intermediate dim, the shared-expert gate
replicated, one all-reduce per MoE block) at tp=2."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

from qwen3_5_utils import F, L, greedy_generate, hf_qwen3_5, hf_qwen3_5_moe, incremental_logits, pools, save  # noqa: E402

from kvpipe.config import ParallelConfig  # noqa: E402
from kvpipe.model.loader import load_model  # noqa: E402

PAGE = 4
IDS = list(range(3, 30))  # 27 tokens: 19 prompt (prefilled in chunks of 5) + 8 decode steps
TABLE = torch.tensor([4, 0, 5, 2, 1, 7, 3])
SLOT = 1


def _run(model_dir: Path, parallel: ParallelConfig) -> dict[str, object]:
    model = load_model(model_dir, parallel)
    kv, state = pools(model, 8, PAGE)
    logits = incremental_logits(
        model, IDS, prompt_len=19, page_size=PAGE, chunk=5, page_table=TABLE, kv=kv, state=state, slot=SLOT
    )
    return {
        "logits": logits,
        "recurrent": [r[SLOT] for r in state.recurrent],
        "greedy": greedy_generate(model, IDS[:9], 16, PAGE),
    }


def _worker(rank: int, world: int, init_file: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", world_size=world, rank=rank)
    torch.save(_run(Path(model_dir), ParallelConfig(world, rank)), Path(out) / f"{rank}.pt")
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's teardown (see test_model_tp.py)


# 4 linear key heads / 8 value heads / 4 query heads split over 4 ranks; 2 KV heads replicate at tp=4
MODELS = {
    "dense": lambda: hf_qwen3_5(
        seed=3,
        num_hidden_layers=4,
        layer_types=[L, F, L, F],
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        attention_bias=True,
    ),
    "moe": lambda: hf_qwen3_5_moe(seed=3, layer_types=[L, F, L, F], linear_num_key_heads=4, linear_num_value_heads=8),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,world", [("dense", 2), ("dense", 4), ("moe", 2)])
def test_tp_matches_tp1(family, world, tmp_path):
    model_dir = str(save(MODELS[family](), tmp_path / "model"))
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), model_dir, str(tmp_path)), nprocs=world, join=True)
    want = _run(Path(model_dir), ParallelConfig())
    heads = 8 // world
    for rank in range(world):
        got = torch.load(tmp_path / f"{rank}.pt")
        torch.testing.assert_close(got["logits"], want["logits"], atol=1e-5, rtol=0, msg=f"rank {rank}")
        assert got["greedy"] == want["greedy"]
        for g, w in zip(got["recurrent"], want["recurrent"]):
            assert g.shape[0] == heads  # this rank's value heads only
            torch.testing.assert_close(g, w[rank * heads : (rank + 1) * heads], atol=1e-5, rtol=0)
