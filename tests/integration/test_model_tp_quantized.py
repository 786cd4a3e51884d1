"""--quantization under tensor parallelism (gloo ranks on the CPU): every rank quantizes its own
shard to the weights TP 1 has (int8 row scales of a row-parallel shard from the whole row, int4
groups and GGUF Q4_1 blocks split on their boundaries), so tp=2 gives tp=1's logits within the
TP tolerance and its greedy tokens, for an HF checkpoint (w8a16, w4a16) and a Q4_1 GGUF (w4a16:
blocks loaded straight, q/k rows permuted in the file)."""

from __future__ import annotations

import pytest
import torch

from kvpipe.config import ParallelConfig
from kvpipe.model.linear import Linear
from kvpipe.model.loader import load_model
from kvpipe.model.quantized_weight import Int4Weight
from tests.helpers.gguf_files import Q, write_gguf
from tests.helpers.paged_model import greedy_generate, incremental_logits
from tests.helpers.tolerance import SAME_BINARY_TP_GAIN, logit_atol
from tests.helpers.tp_ranks import run_ranks

PAGE = 4
IDS = list(range(3, 23))  # 13 prompt tokens in chunks of 5, then 7 decode steps
GREEDY = 16


def _run(model_path: str, mode: str, parallel: ParallelConfig) -> dict:
    model = load_model(model_path, parallel, quantization=mode)
    logits = incremental_logits(model, IDS, prompt_len=13, page_size=PAGE, chunk=5)
    kinds = sorted({type(m.quant).__name__ for m in model.layers.modules() if isinstance(m, Linear)})
    return {"logits": logits, "greedy": greedy_generate(model, IDS[:10], GREEDY, page_size=PAGE), "kinds": kinds}


def _run_all(parallel: ParallelConfig, cases: dict[str, tuple[str, str]]) -> dict[str, dict]:
    return {name: _run(path, mode, parallel) for name, (path, mode) in cases.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case, mode",
    [
        ("gguf_q4_1", "w4a16"),  # Q4_1 blocks straight, rows and whole-block columns per rank
        pytest.param("tiny", "w8a16", marks=pytest.mark.slow),  # int8 row scales from the whole row
        pytest.param("tiny", "w4a16", marks=pytest.mark.slow),  # int4 groups quantized from the values
    ],
)
def test_quantized_tp2_matches_tp1(tiny_model_dir, tmp_path, case, mode):
    path = str(tiny_model_dir) if case == "tiny" else str(write_gguf(tmp_path / "q4_1.gguf", "llama", Q.Q4_1).path)
    ranks = run_ranks(_run_all, 2, tmp_path, {case: (path, mode)})
    want = _run(path, mode, ParallelConfig())
    assert want["kinds"] == (["Int8Weight"] if mode == "w8a16" else [Int4Weight.__name__])
    model = load_model(path, quantization=mode)
    atol = logit_atol(want["logits"], model.cfg, len(IDS), gain=SAME_BINARY_TP_GAIN)
    for rank in range(2):
        got = ranks[rank][case]
        assert got["kinds"] == want["kinds"] and got["greedy"] == want["greedy"], f"rank {rank}"
        torch.testing.assert_close(got["logits"], want["logits"], atol=atol, rtol=0, msg=f"rank {rank}")
