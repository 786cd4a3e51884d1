"""--quantization under tensor parallelism (gloo ranks on the CPU): every rank quantizes its own
shard to exactly the weights TP 1 holds for it (int8 row scales of a row-parallel shard taken
from the whole row; int4 groups and GGUF Q4_1 blocks split on their boundaries, q/k rows
permuted in the file). Compared weight by weight, bit for bit, as the kernels see them. (Logits
are not compared: a row-parallel layer's partial sums are rounded per rank before the
all-reduce, a difference of fp32 size that tolerances elsewhere cover.)"""

from __future__ import annotations

import pytest
import torch

from kvpipe.config import ParallelConfig
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.layers.linear import Linear
from kvpipe.model.quant.weights import Int4Weight, Int8Weight
from tests.helpers.gguf_files import Q, write_gguf
from tests.helpers.tp_ranks import run_ranks


def _weights(parallel: ParallelConfig, model_path: str, mode: str) -> dict[str, tuple]:
    """Each decoder Linear's weight as its kernel multiplies with it ([N, K], fp32), its kind and
    its Shard as (dim, ranges) (plain data: the ranks' results are loaded with weights_only)."""
    model = load_model(model_path, parallel, quantization=mode)
    out = {}
    for name, m in model.layers.named_modules():
        if isinstance(m, Linear):
            q = m.quant
            assert isinstance(q, Int8Weight | Int4Weight), name
            w = q.dequantize()
            out[name] = (type(q).__name__, w, None if m.shard is None else (m.shard.dim, m.shard.ranges))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case, mode",
    [
        ("gguf_q4_1", "w4a16"),  # Q4_1 blocks straight, rows and whole-block columns per rank
        ("tiny", "w8a16"),  # int8 row scales from the whole row
        pytest.param("tiny", "w4a16", marks=pytest.mark.slow),  # int4 groups quantized from the values
    ],
)
def test_each_rank_holds_tp1s_quantized_slice(tiny_model_dir, tmp_path, monkeypatch, case, mode):
    monkeypatch.setenv("KVPIPE_FUSE_PROJECTIONS", "0")  # each projection with its own shard (the ranks inherit it)
    path = str(tiny_model_dir) if case == "tiny" else str(write_gguf(tmp_path / "q4_1.gguf", "llama", Q.Q4_1).path)
    ranks = run_ranks(_weights, 2, tmp_path, path, mode)
    want = _weights(ParallelConfig(), path, mode)
    for rank, got in enumerate(ranks):
        assert got.keys() == want.keys()
        for name, (kind, w, shard) in got.items():
            full_kind, full, _ = want[name]
            assert kind == full_kind, name
            assert shard is not None, name
            dim, ranges = shard
            lead = (slice(None),) * dim
            part = torch.cat([full[lead + (slice(a, a + n),)] for a, n in ranges], dim=dim)
            assert torch.equal(w, part), f"rank {rank} {name} ({kind}): max diff {float((w - part).abs().max())}"
