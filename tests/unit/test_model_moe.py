"""Sparse MoE: routing as a pure function, dispatch bookkeeping, SparseMoE against HF's sparse MoE
block of each family (Qwen3-MoE, MiniMax-M2, DeepSeek-V3), and the loader's
handling of the MoE families (options it refuses, the fp32 routing bias)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model import registry
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.checkpoint.schema import MoEConfig
from kvpipe.model.families.causal_lm import check_parallel
from kvpipe.model.families.qwen3_moe import Qwen3MoeCausalLM
from kvpipe.model.layers.moe import Dispatch, SparseMoE, check_routing, route
from kvpipe.model.presets import write_preset
from tests.helpers.paged_model import incremental_logits
from tests.helpers.tolerance import assert_close_logits

# transformers comes with the `test` extra: without it this module is skipped, not failed, so the
# helpers that build HF blocks are imported after the check
transformers = pytest.importorskip("transformers")

from tests.helpers.moe_block import (  # noqa: E402
    ARCHS,
    COMMON,
    HF_CONFIGS,
    HIDDEN,
    family_of,
    hf_block,
    hf_config,
    our_config,
    ours_for,
)


def sort_slots(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing's k slots in ascending expert order (top-k order is not part of the contract)."""
    experts, order = experts.sort(dim=-1)
    return weights.gather(1, order), experts


# ---- routing, a pure function of the router logits --------------------------------------------


def moe_config(**kw) -> MoEConfig:
    base = dict(num_experts=4, top_k=2, expert_intermediate_size=8, scoring="softmax", norm_topk_prob=False)
    return MoEConfig(**(base | kw))


def test_route_softmax_top_k_with_and_without_renorm():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 3.0, 2.5]])
    probs = torch.softmax(logits, -1)
    w, e = sort_slots(*route(logits, moe_config()))
    assert e.tolist() == [[0, 2], [2, 3]]
    torch.testing.assert_close(w, torch.stack([probs[0, [0, 2]], probs[1, [2, 3]]]))
    w_norm, e_norm = sort_slots(*route(logits, moe_config(norm_topk_prob=True)))
    assert torch.equal(e_norm, e)
    torch.testing.assert_close(w_norm, w / w.sum(-1, keepdim=True))


def test_route_sigmoid_bias_steers_choice_not_weights():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 is chosen only thanks to the bias
    cfg = moe_config(scoring="sigmoid", norm_topk_prob=True, correction_bias=True, routed_scaling_factor=2.0)
    w, e = sort_slots(*route(logits, cfg, bias))
    assert e.tolist() == [[0, 3]]
    s = torch.sigmoid(logits[0, [0, 3]])
    torch.testing.assert_close(w[0], 2.0 * s / s.sum())  # weighted by the plain scores


def test_route_group_limited_excludes_a_group_with_one_strong_expert():
    # 8 experts in 4 groups of 2, the best 2 groups. Expert 0 has the best score, but its group
    # (0, 1) sums to less than groups (2, 3) and (4, 5), so experts 0 and 1 are out.
    scores = torch.tensor([[0.95, 0.05, 0.7, 0.6, 0.65, 0.6, 0.1, 0.1]])
    logits = torch.logit(scores)
    cfg = moe_config(num_experts=8, top_k=2, scoring="sigmoid", norm_topk_prob=False, num_groups=4, topk_groups=2)
    _, e = sort_slots(*route(logits, cfg))
    assert e.tolist() == [[2, 4]]
    _, e_flat = sort_slots(*route(logits, dataclasses.replace(cfg, num_groups=1, topk_groups=1)))
    assert e_flat.tolist() == [[0, 2]]


@pytest.mark.parametrize("case", sorted(HF_CONFIGS))
@torch.no_grad()
def test_route_matches_hf_router(case):
    cfg, block = hf_block(case)
    x = torch.randn(200, HIDDEN, generator=torch.Generator().manual_seed(1))
    if family_of(case) == "minimax_m2":
        _, want_w, want_e = block.gate(x, block.e_score_correction_bias)
        bias = block.e_score_correction_bias
    else:
        _, want_w, want_e = block.gate(x)
        bias = getattr(block.gate, "e_score_correction_bias", None)
    ours = our_config(cfg, case).moe
    got_w, got_e = sort_slots(*route(x @ block.gate.weight.T, ours, bias))
    want_w, want_e = sort_slots(want_w.float(), want_e)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=0)
    if ours.num_groups > 1:  # the group limit is exercised: plain top-k would pick other experts
        flat = dataclasses.replace(ours, num_groups=1, topk_groups=1)
        assert not torch.equal(sort_slots(*route(x @ block.gate.weight.T, flat, bias))[1], got_e)


def test_dispatch_groups_pairs_by_expert():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])  # token -> its k=2 experts
    plan = Dispatch.build(experts, num_experts=4)
    assert plan.counts == (2, 1, 3, 0)
    assert plan.order.tolist() == [1, 4, 3, 0, 2, 5]  # flat (token * k + slot), stable within an expert
    assert plan.tokens.tolist() == [0, 2, 1, 0, 1, 2]


def test_check_routing_rejects_impossible_groups():
    with pytest.raises(ConfigError, match="groups"):
        check_routing(moe_config(num_experts=8, scoring="sigmoid", num_groups=3, topk_groups=1))
    with pytest.raises(ConfigError, match="groups"):
        check_routing(moe_config(num_experts=8, top_k=5, scoring="sigmoid", num_groups=4, topk_groups=2))
    with pytest.raises(ConfigError, match="scoring"):
        check_routing(moe_config(scoring="sqrtsoftplus"))


# ---- SparseMoE, module level -------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 57])
@pytest.mark.parametrize("case", sorted(HF_CONFIGS))
@torch.no_grad()
def test_sparse_moe_matches_hf_block(case, tokens):
    cfg, block = hf_block(case)
    ours = ours_for(case, cfg, block)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ours(x), block(x[None])[0], atol=1e-6, rtol=0)


@torch.no_grad()
def test_experts_without_tokens_do_not_run():
    cfg, block = hf_block("deepseek_v3")
    ours = ours_for("deepseek_v3", cfg, block)
    ran: list[int] = []
    for e, expert in enumerate(ours.experts):
        expert.register_forward_hook(lambda mod, args, out, e=e: ran.append(e))
    ours(torch.randn(1, HIDDEN))
    assert len(ran) == ours.moe.top_k == len(set(ran))  # one token: only its top_k experts ran, once each


def test_sparse_moe_refuses_a_dense_layer():
    cfg, _ = hf_block("deepseek_v3")
    with pytest.raises(ValueError, match="dense"):
        SparseMoE(our_config(cfg, "deepseek_v3"), 0, ParallelConfig(), None)


def test_sparse_layers_follow_hf_decoder_sparse_step_and_mlp_only_layers():
    hf_cfg = transformers.Qwen3MoeConfig(
        **(COMMON | HF_CONFIGS["qwen3_moe"] | dict(num_hidden_layers=6)), decoder_sparse_step=2, mlp_only_layers=[3]
    )
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_cfg)
        ours = Qwen3MoeCausalLM(our_config(hf_cfg, "qwen3_moe"))
    want = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert want == [False, True, False, False, False, True]
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.layers] == want


# ---- the MoE families in the loader ------------------------------------------------------------


@pytest.fixture(scope="module")
def minimax_dir(tmp_path_factory) -> Path:
    return write_preset("tiny-minimax-m2", tmp_path_factory.mktemp("tiny_minimax_m2"))


def edited_copy(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | changes))
    return dst


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(qk_norm_type="per_head"), "qk_norm_type"),
        (dict(attn_type_list=[0, 1, 1, 1]), "attn_type_list"),  # lightning attention (MiniMax-Text-01)
        (dict(shared_intermediate_size=64), "shared_intermediate_size"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_unsupported_minimax_options_are_refused(minimax_dir, tmp_path, change, match):
    with pytest.raises(ConfigError, match=match):
        load_model(edited_copy(minimax_dir, tmp_path / "m", **change))


def test_unimplemented_family_is_refused(tmp_path, monkeypatch):
    # every recognised family is implemented now (deepseek_v3 by the mla branch): take one out
    monkeypatch.delitem(registry.FAMILIES, "deepseek_v3")
    (tmp_path / "config.json").write_text(
        json.dumps(hf_config("deepseek_v3").to_dict() | {"architectures": [ARCHS["deepseek_v3"]]})
    )
    with pytest.raises(ConfigError, match="deepseek_v3 model family is not implemented"):
        load_model(tmp_path)


def test_tp_split_of_expert_sizes_is_checked():
    cfg = our_config(hf_config("qwen3_moe"), "qwen3_moe")
    cfg = dataclasses.replace(
        cfg,
        num_heads=6,
        num_kv_heads=3,
        intermediate_size=96,
        moe=dataclasses.replace(cfg.moe, dense_layers=(), expert_intermediate_size=32),
    )
    with pytest.raises(ConfigError, match="expert_intermediate_size=32"):
        check_parallel(cfg, ParallelConfig(3, 0))
    # no dense layer: intermediate_size is unused and need not split
    check_parallel(dataclasses.replace(cfg, num_heads=4, num_kv_heads=2, intermediate_size=95), ParallelConfig(2, 0))


def test_checkpoint_names_and_bf16_keep_routing_bias_fp32(minimax_dir):
    model = load_model(minimax_dir, dtype="bfloat16")
    gate = model.layers[0].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.e_score_correction_bias.dtype == torch.float32
    ref = load_model(minimax_dir)
    torch.testing.assert_close(
        gate.e_score_correction_bias, ref.layers[0].mlp.gate.e_score_correction_bias, atol=0, rtol=0
    )
    assert model.layers[0].self_attn.q_norm.weight.shape == (4 * 32,)  # over all heads


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-minimax-m2"])
def test_moe_presets_match_hf(preset, tmp_path):
    path = write_preset(preset, tmp_path / preset)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCHS[model_config_of(path).architecture]
    ours = load_model(path)
    ids = torch.randint(0, ours.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    got = incremental_logits(ours, ids, prompt_len=11, page_size=4, chunk=5)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert_close_logits(got, want, ours.cfg, len(ids))
