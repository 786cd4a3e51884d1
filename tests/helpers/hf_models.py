"""Random tiny HF checkpoints of the dense and MoE CausalLM families (Llama, Qwen2, Qwen3,
Qwen3-MoE, MiniMax-M2) for the parity tests, and what every parity test needs around them: a
checkpoint writer, deterministic prompts and HF's own logits."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB = 160  # the random tiny HF models' vocabulary in the parity tests

MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False),
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2),  # intermediate_size: per expert
}


def save(model, path: Path, **kw) -> Path:
    """An HF model written as a checkpoint directory (safetensors) at `path`."""
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def prompt_ids(n: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """An HF causal LM's fp32 logits of every position of one sequence, [len(ids), vocab]."""
    return hf(torch.tensor([ids])).logits[0].float()


def hf_model(family: str, seed: int = 0, **overrides):
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "minimax_m2": (transformers.MiniMaxM2Config, transformers.MiniMaxM2ForCausalLM),
    }[family]
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(MOE_DEFAULTS.get(family, {}))
    kw.update(overrides)
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kw)).eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            # HF zero-inits biases (Qwen2 q/k/v, the MoE correction bias) and sets norms to one;
            # random values make those paths, and their TP slicing, observable
            if (family == "qwen2" and name.endswith("bias")) or name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.5 if family == "qwen2" else 0.1)
            elif family == "minimax_m2" and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.2)
    return model
