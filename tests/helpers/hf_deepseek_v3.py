"""Random tiny HF DeepSeek-V3 checkpoints (multi-head latent attention, group-limited MoE, yarn
RoPE) and the parity tests' cases."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import torch
import transformers

from tests.helpers.hf_models import VOCAB

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11


class MlaKwargs(TypedDict, total=False):
    """The DeepseekV3Config keyword arguments the tiny checkpoints set (typed, so mypy checks them
    against the config's fields)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    max_position_embeddings: int
    initializer_range: float
    rope_interleave: bool
    rope_parameters: dict[str, object]
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


YARN: dict[str, object] = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
    "rope_theta": 10000.0,
}
CASES: dict[str, MlaKwargs] = {
    # q LoRA (q_a_proj -> q_a_layernorm -> q_b_proj), interleaved rope pairs; layer 0 dense, then MoE
    "qlora_interleave_moe": MlaKwargs(q_lora_rank=24, rope_interleave=True, first_k_dense_replace=1),
    # one full q_proj; yarn (inv_freq ramp, cos/sin attention_factor, mscale_all_dim softmax scale);
    # random q_a/kv_a/o biases (o_proj's added once after the TP all-reduce); MoE from layer 1
    "noqlora_yarn_bias_moe": MlaKwargs(
        q_lora_rank=None, rope_interleave=True, rope_parameters=YARN, attention_bias=True, first_k_dense_replace=1
    ),
    # rotate_half rope layout, every layer dense
    "qlora_rotate_half_dense": MlaKwargs(q_lora_rank=24, rope_interleave=False, first_k_dense_replace=3),
}


def hf_mla_model(seed: int = 0, **overrides: Unpack[MlaKwargs]) -> transformers.DeepseekV3ForCausalLM:
    """A random tiny DeepSeek-V3: layers before first_k_dense_replace dense, the others sparse
    (8 experts in 4 groups, top-2 from the best 2 groups, one shared expert)."""
    kw = MlaKwargs(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=10,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=3,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw)).eval()
    with torch.no_grad():
        if kw.get("attention_bias"):  # HF zero-inits biases; random ones make the bias path observable
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
        for name, b in model.named_buffers():  # a nonzero routing bias, so it steers the choice
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return model
