"""The EAGLE head (kvpipe/model/draft/eagle.py) against plain torch on the same tensors: fc over
cat(embedding of t_{i+1}, h_i) (with its bias), one Llama layer without its input_layernorm (GQA
attention with RoPE, SwiGLU MLP after post_attention_layernorm), the target's lm_head on the
output with no final norm (SGLang's LlamaForCausalLMEagle); fp32, for the tiny preset's dims.
The head runs over its own one-layer paged K/V pool as the drafter runs it: an extend, a chunk
behind it, then single-token steps. Also: the head's own embedding when the checkpoint has one,
a wrong hidden input changes the logits, and what is not an EAGLE head for the target is refused."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.draft.eagle import EagleHead, check_eagle_head, eagle_config, eagle_tensor_name, load_eagle
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.presets import preset_config
from tests.helpers.draft_models import write_eagle_head
from tests.helpers.hf_models import prompt_ids
from tests.helpers.paged_model import all_logits
from tests.helpers.tolerance import assert_close_logits

PAGE = 4


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_eagle_head(tiny_model_dir, tmp_path_factory.mktemp("eagle") / "head", seed=3)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """HF Llama's RoPE (rotate_half) on x [T, heads, D] at positions pos [T]."""
    d = x.shape[-1]
    ang = pos[:, None].float() * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


@torch.no_grad()
def reference_head(
    w: dict[str, torch.Tensor], tw: dict[str, torch.Tensor], cfg: ModelConfig, hidden: torch.Tensor, ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's EAGLE math over positions 0 .. L-1 (h_i [L, H], t_{i+1}) in plain torch -> (out, logits)."""
    n, d, p = len(ids), cfg.head_dim, "layers.0."
    e = tw["model.embed_tokens.weight"][torch.tensor(ids)]
    x = torch.cat([e, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    pos = torch.arange(n)
    q = rotate((x @ w[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_heads, d), pos, cfg.rope_theta)
    k = rotate((x @ w[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_kv_heads, d), pos, cfg.rope_theta)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_kv_heads, d)
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5 + torch.full((n, n), float("-inf")).triu(1)
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    x = x + o @ w[p + "self_attn.o_proj.weight"].T  # no input_layernorm before the attention
    y = rms(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    mlp = (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"
    ].T
    out = x + mlp
    return out, out @ tw["lm_head.weight"].T  # the target's lm_head, no final norm


def target_parts(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    tw = load_file(str(path / "model.safetensors"))
    return tw["model.embed_tokens.weight"], tw["lm_head.weight"]


def loaded(head_dir: Path, target: Path) -> EagleHead:
    head = load_eagle(head_dir, model_config_of(target))
    embed, lm_head = target_parts(target)
    head.set_target(embed, lambda h: h @ lm_head.T)
    return head


def run_head(head: EagleHead, pool: KVPool, hidden: torch.Tensor, ids: list[int], cuts: list[int]):
    """The head over positions 0 .. L-1 in pieces [cuts[i], cuts[i+1]) on one page table."""
    table = torch.arange(pool.num_pages, dtype=torch.int64)
    outs, logits = [], []
    for a, b in zip(cuts, cuts[1:]):
        fb = all_logits(ForwardBatch.build([ids[a:b]], [a], [table[: -(-b // PAGE)]], PAGE))
        with torch.inference_mode():
            o, lg = head(hidden[a:b], fb, pool)
        outs.append(o)
        logits.append(lg)
    return torch.cat(outs), torch.cat(logits)


def test_head_forward_matches_plain_torch(tiny_model_dir: Path, head_dir: Path):
    cfg = model_config_of(tiny_model_dir)
    w, tw = load_file(str(head_dir / "model.safetensors")), load_file(str(tiny_model_dir / "model.safetensors"))
    n = 30
    ids = prompt_ids(n, seed=4, vocab=cfg.vocab_size)
    hidden = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    want_out, want_logits = reference_head(w, tw, cfg, hidden, ids)
    head = loaded(head_dir, tiny_model_dir)
    assert head.embed_tokens is None and head.fc.bias is not None  # the target's embedding; fc's bias read
    shape = Shape(cfg.num_layers + 1, cfg.hidden_size)
    for cuts in ([0, n], [0, 11, 20, *range(21, n + 1)]):
        pool = head.kv_pool(16, PAGE, "cpu")
        assert (pool.num_layers, pool.kv_heads, pool.head_dim, pool.latent) == (
            1,
            cfg.num_kv_heads,
            cfg.head_dim,
            False,
        )
        out, logits = run_head(head, pool, hidden, ids, cuts)
        assert_close_logits(logits, want_logits, shape, n, msg=f"EAGLE logits, pieces {cuts[:4]}..")
        assert_close_logits(out, want_out, shape, n, msg="EAGLE output hidden states")
    # the hidden input matters: the previous row's h gives other logits
    _, wrong = run_head(head, head.kv_pool(16, PAGE, "cpu"), torch.roll(hidden, 1, 0), ids, [0, n])
    assert (wrong - want_logits).abs().max() > 100 * (logits - want_logits).abs().max()


def test_own_embedding_and_model_prefixed_names(tiny_model_dir: Path, head_dir: Path, tmp_path: Path):
    """A checkpoint's embed_tokens is the head's embedding (the target's serves where it has none);
    tensors under `model.` load the same; its lm_head and input_layernorm are never read."""
    w = load_file(str(head_dir / "model.safetensors"))
    embed, _ = target_parts(tiny_model_dir)
    own = embed.flip(0).contiguous()  # another table: every token embeds as another's
    prefixed = {"model." + k: v for k, v in w.items()} | {"model.embed_tokens.weight": own}
    prefixed["lm_head.weight"] = torch.full_like(embed, float("nan"))
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.json").write_text((head_dir / "config.json").read_text())
    save_file(prefixed, str(tmp_path / "h" / "model.safetensors"))
    assert eagle_tensor_name("fc.weight", set(prefixed)) == "model.fc.weight"
    assert eagle_tensor_name("fc.weight", set(w)) == "fc.weight"
    head = loaded(tmp_path / "h", tiny_model_dir)
    assert head.embed_tokens is not None and torch.equal(head.embed_tokens, own)
    ids = torch.tensor([3, 7, 11])
    assert torch.equal(head.embed(ids), own[ids])
    hidden = torch.randn(3, embed.shape[1])
    fb = ForwardBatch.build([ids.tolist()], [0], [torch.arange(4)], PAGE)
    with torch.inference_mode():
        out, logits = head(hidden, fb, head.kv_pool(4, PAGE, "cpu"))
    assert torch.isfinite(logits).all()  # the NaN lm_head of the checkpoint was not used


def test_what_is_not_an_eagle_head_for_the_target_is_refused(tiny_model_dir: Path, head_dir: Path, tmp_path: Path):
    raw = json.loads((head_dir / "config.json").read_text())
    for name, change, match in (
        ("plain", {"architectures": ["LlamaForCausalLM"]}, "not an EAGLE head"),
        ("deep", {"num_hidden_layers": 2}, "one decoder layer"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw | change))
        with pytest.raises(ConfigError, match=match):
            eagle_config(tmp_path / name)
    head, target = eagle_config(head_dir), model_config_of(tiny_model_dir)
    check_eagle_head(head, target, head_dir)
    with pytest.raises(ConfigError, match="hidden_size 64 is not the target's"):
        check_eagle_head(dataclasses.replace(head, hidden_size=64), target, head_dir)
    with pytest.raises(ConfigError, match="vocab_size"):
        check_eagle_head(dataclasses.replace(head, vocab_size=7), target, head_dir)
    with pytest.raises(ConfigError, match="Llama-family targets"):
        check_eagle_head(head, preset_config("tiny-deepseek-v3"), head_dir)
