"""Tensor parallelism of the CausalLM families on gloo process groups (CPU): tp=2 and tp=4 (more
ranks than KV heads) give the logits and greedy tokens of tp=1, and each rank's KV pool holds
exactly its slice of the KV heads (dense, Qwen3-MoE, MiniMax-M2, GPT-OSS) or the whole latent
(DeepSeek-V3's MLA); DeepSeek-V3's sparse MoE block alone under TP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpipe.config import ParallelConfig
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from tests.helpers.paged_model import greedy_generate, incremental_logits, make_pool
from tests.helpers.tolerance import assert_close_logits
from tests.helpers.tp_ranks import run_ranks

# transformers comes with the `test` extra: without it this module is skipped, not failed, so the
# helpers that build HF models are imported after the check
transformers = pytest.importorskip("transformers")

from tests.helpers.hf_deepseek_v3 import CASES as MLA_CASES  # noqa: E402
from tests.helpers.hf_deepseek_v3 import hf_mla_model  # noqa: E402
from tests.helpers.hf_gpt_oss import CASES as GPT_OSS_CASES  # noqa: E402
from tests.helpers.hf_gpt_oss import hf_gpt_oss  # noqa: E402
from tests.helpers.hf_models import hf_model, save  # noqa: E402
from tests.helpers.moe_block import HIDDEN, hf_block, ours_for  # noqa: E402

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


def _run_all(parallel: ParallelConfig, dirs: dict[str, str]) -> dict[str, dict]:
    out = {}
    for name, d in dirs.items():
        logits, kv, greedy = _run(Path(d), parallel)
        out[name] = {"logits": logits, "kv": kv, "greedy": greedy}
    return out


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
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_matches_tp1(world, model_dirs, tmp_path):
    ranks = run_ranks(_run_all, world, tmp_path, model_dirs)
    for name, d in model_dirs.items():
        want_logits, want_kv, want_greedy = _run(Path(d), ParallelConfig())
        cfg = model_config_of(d)
        num_kv = cfg.num_kv_heads
        for rank in range(world):
            got = ranks[rank][name]
            assert got["greedy"] == want_greedy, f"{name} rank {rank}"
            assert_close_logits(got["logits"], want_logits, cfg, len(IDS), msg=f"{name} rank {rank}")
            par = ParallelConfig(world, rank)
            h0, n = par.kv_head_start(num_kv), par.local_kv_heads(num_kv)
            for layer, (g, w) in enumerate(zip(got["kv"], want_kv)):
                # [2, pages, heads, page, dim]: this rank's heads only
                assert g.shape[2] == n
                assert_close_logits(g, w[:, :, h0 : h0 + n], cfg, len(IDS), msg=f"{name} L{layer} r{rank}")


# ---- GPT-OSS -------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gpt_oss_tp_matches_tp1(world, tmp_path):
    """Heads, KV heads (replicated at tp 4), sinks and experts' intermediate dim sliced; greedy
    tokens and logits of tp=1 (the dense models' harness: 13-token prompt in chunks of 5, decode
    past the window of 8, 32 greedy tokens)."""
    d = str(save(hf_gpt_oss(**GPT_OSS_CASES["alternating_gqa"]), tmp_path / "model"))
    ranks = run_ranks(_run_all, world, tmp_path, {"gpt_oss": d})
    want_logits, _, want_greedy = _run(Path(d), ParallelConfig())
    for rank in range(world):
        got = ranks[rank]["gpt_oss"]
        assert got["greedy"] == want_greedy, f"rank {rank}"
        assert_close_logits(got["logits"], want_logits, model_config_of(d), len(IDS), msg=f"rank {rank}")


# ---- DeepSeek-V3: multi-head latent attention ------------------------------------------------------


def _mla_run(model_dir: Path, parallel: ParallelConfig) -> dict:
    model = load_model(model_dir, parallel)
    pool = make_pool(model, 6, PAGE)
    logits = incremental_logits(model, IDS, prompt_len=13, page_size=PAGE, chunk=5, page_table=TABLE, pool=pool)
    return {
        "logits": logits,
        "latent": [pool.k[i] for i in range(model.num_layers)],
        "greedy": greedy_generate(model, IDS[:7], 24, page_size=PAGE),
    }


def _mla_run_all(parallel: ParallelConfig, dirs: dict[str, str]) -> dict[str, dict]:
    return {name: _mla_run(Path(d), parallel) for name, d in dirs.items()}


@pytest.fixture(scope="module")
def mla_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mla_tp")
    return {
        name: str(save(hf_mla_model(**MLA_CASES[name]), root / name))
        for name in ("qlora_interleave_moe", "noqlora_yarn_bias_moe")
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mla_tp_matches_tp1(world, mla_model_dirs, tmp_path):
    """Heads split over 2 and 4 ranks: the logits and greedy tokens of tp=1, and every rank caches
    the whole latent (the one replicated "head")."""
    ranks = run_ranks(_mla_run_all, world, tmp_path, mla_model_dirs)
    for name, d in mla_model_dirs.items():
        want = _mla_run(Path(d), ParallelConfig())
        cfg = model_config_of(d)
        for rank in range(world):
            got = ranks[rank][name]
            assert got["greedy"] == want["greedy"], f"{name} rank {rank}"
            assert_close_logits(got["logits"], want["logits"], cfg, len(IDS), msg=f"{name} rank {rank}")
            for layer, (g, w) in enumerate(zip(got["latent"], want["latent"])):
                assert g.shape == w.shape
                assert_close_logits(g, w, cfg, len(IDS), msg=f"{name} L{layer} r{rank}")


# ---- DeepSeek-V3's sparse MoE block ----------------------------------------------------------------


@torch.no_grad()
def _moe_block_output(parallel: ParallelConfig, case: str) -> torch.Tensor:
    cfg, block = hf_block(case)
    return ours_for(case, cfg, block, parallel)(torch.randn(33, HIDDEN, generator=torch.Generator().manual_seed(3)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_deepseek_sparse_moe_tp_matches_tp1(world, tmp_path):
    """DeepSeek-V3's block under TP: routed and shared experts sliced, one all-reduce."""
    ranks = run_ranks(_moe_block_output, world, tmp_path, "deepseek_v3")
    want = _moe_block_output(ParallelConfig(), "deepseek_v3")
    for rank in range(world):
        torch.testing.assert_close(ranks[rank], want, atol=1e-6, rtol=0)
