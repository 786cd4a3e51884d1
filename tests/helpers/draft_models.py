"""Draft models for the STANDALONE drafter's tests (engine/spec/draft_model.py), MTP layers for the
NEXTN drafter's (engine/spec/mtp_drafter.py) and EAGLE heads for the EAGLE drafter's
(engine/spec/eagle_drafter.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvpipe.model.checkpoint.config_reader import model_config_of


def noisy_copy(src: Path, dst: Path, scale: float = 0.1) -> Path:
    """`src` with seeded noise (scale x each matrix's std) on every weight matrix: a draft that
    agrees with the target often but not always (a part of each chain accepted)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if w.ndim == 2:
            noise = scale * w.float().std() * torch.randn(w.shape, generator=g)
            weights[name] = (w.float() + noise).to(w.dtype)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def bigram_copy(src: Path, dst: Path) -> Path:
    """`src` with every o_proj and down_proj (and a Qwen3.5 delta-net layer's out_proj) zeroed
    (each layer adds nothing to the residual, so the target's next token depends on the last
    token only) and the MTP's input projection (DeepSeek-V3's eh_proj, Qwen3.5's mtp.fc) keeping
    the embedding half (its guess after t_{i+1} is the target's own next token after t_{i+1}):
    an MTP layer that drafts exactly what the target generates."""
    shutil.copytree(src, dst)
    cfg = model_config_of(src)
    weights = load_file(str(dst / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")):
            weights[name] = torch.zeros_like(w)
    h = cfg.hidden_size
    if cfg.hybrid is not None:  # Qwen3.5: its mtp.* layer
        weights["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    elif cfg.num_nextn_predict_layers:  # a Llama target has no MTP layer (its EAGLE head: write_eagle_head)
        weights[f"model.layers.{cfg.num_layers}.eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_eagle_head(target: Path, dst: Path, bigram: float = 0.0, noise: float = 1.0, seed: int = 0) -> Path:
    """An EAGLE head for the Llama checkpoint `target` (model/draft/eagle.py's format: config.json with
    architectures ["LlamaForCausalLMEagle"] and one layer of the target's dims; tensors named as
    SGLang's EAGLE checkpoints, with an fc bias and the unused layers.0.input_layernorm). Each
    tensor is `bigram` x the exact head's plus `noise` x a seeded random one (std 1/sqrt(fan_in),
    as the presets'). The exact head (bigram 1, noise 0) predicts a bigram_copy target exactly:
    fc keeps the embedding half times the target's final-norm weight and the layer adds nothing,
    so its logits are the target's after t_{i+1} scaled by that embedding's RMS (same argmax)."""
    dst.mkdir(parents=True)
    raw = json.loads((target / "config.json").read_text())
    raw.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    cfg = model_config_of(target)
    tw = load_file(str(target / "model.safetensors"))
    h, q, kv, inter = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (q, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
    }
    exact = {name: torch.zeros(shape) for name, shape in shapes.items()}
    exact["fc.weight"][:, :h] = torch.diag(tw["model.norm.weight"].float())
    weights = {
        name: bigram * exact[name] + noise * torch.randn(shape, generator=g) / shape[1] ** 0.5
        for name, shape in shapes.items()
    }
    weights["fc.bias"] = noise * 0.1 * torch.randn(h, generator=g)
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(h) + noise * 0.1 * torch.randn(h, generator=g)
    weights["layers.0.input_layernorm.weight"] = torch.full((h,), 7.0)  # EAGLE drops it: never read
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )
    return dst
