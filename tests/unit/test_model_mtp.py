"""DeepSeek-V3's multi-token-prediction layer (kvpipe/model/draft/mtp.py) against a reference on the
same weights: the MTP's own parts (enorm, hnorm, eh_proj, shared_head) in plain torch over the
checkpoint's tensors, its decoder layer as HF transformers runs layer 4 of a model built one
layer deeper (the MTP layer's decoder tensors sit under model.layers.4., as any layer's); fp32,
on the tiny-deepseek-v3 preset. The MTP runs over its own one-layer latent paged pool as the
drafter runs it: an extend, a chunk behind it, then single-token (absorbed decode) steps. Also:
the target's captured hidden states are HF's last hidden state (after the final norm)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import CacheConfig, ConfigError
from kvpipe.engine.batch import ForwardSpec
from kvpipe.engine.model_runner import ModelRunner
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.draft.mtp import DeepseekMTP, load_mtp
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.presets import write_preset
from tests.helpers.hf_models import prompt_ids
from tests.helpers.paged_model import all_logits
from tests.helpers.tolerance import assert_close_logits

transformers = pytest.importorskip("transformers")

PAGE = 4
MTP_LAYER = "model.layers.4."  # the tiny preset has 4 decoder layers, then its MTP layer


@dataclass(frozen=True)
class Shape:
    """The depth the hidden states went through: the target's layers and the MTP's."""

    num_layers: int
    hidden_size: int


@pytest.fixture(scope="module")
def preset(tmp_path_factory) -> Path:
    return write_preset("tiny-deepseek-v3", tmp_path_factory.mktemp("tiny_deepseek_v3"))


@pytest.fixture(scope="module")
def hf_deeper(preset):
    """HF's DeepSeek-V3 with num_hidden_layers + 1: its last layer is the MTP layer's decoder."""
    cfg = transformers.AutoConfig.from_pretrained(preset)
    cfg.num_hidden_layers += 1
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        preset, config=cfg, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def reference_mtp(
    hf, w: dict[str, torch.Tensor], hidden: torch.Tensor, next_ids: list[int], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's MTP math over positions 0 .. L-1: h_i [L, H] and t_{i+1} -> (out [L, H], logits [L, V])."""
    p, n = MTP_LAYER, len(next_ids)
    e = rms(w[p + "embed_tokens.weight"][torch.tensor(next_ids)], w[p + "enorm.weight"], eps)
    x = torch.cat([e, rms(hidden, w[p + "hnorm.weight"], eps)], dim=-1) @ w[p + "eh_proj.weight"].T
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    layer = hf.model.layers[hf.config.num_hidden_layers - 1]
    x = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x[None], pos))
    out = rms(x[0], w[p + "shared_head.norm.weight"], eps)
    return out, out @ w[p + "shared_head.head.weight"].T


def mtp_pool(cfg: ModelConfig, pages: int) -> KVPool:
    assert cfg.mla is not None
    return KVPool(1, pages, PAGE, 1, cfg.mla.latent_dim, latent=True)


def run_mtp(mtp: DeepseekMTP, pool: KVPool, hidden: torch.Tensor, next_ids: list[int], cuts: list[int]):
    """The MTP over positions 0 .. L-1 in pieces [cuts[i], cuts[i+1]) on one page table, every
    row's logits -> (out [L, H], logits [L, V])."""
    table = torch.arange(pool.num_pages, dtype=torch.int64)
    outs, logits = [], []
    for a, b in zip(cuts, cuts[1:]):
        fb = all_logits(ForwardBatch.build([next_ids[a:b]], [a], [table[: -(-b // PAGE)]], PAGE))
        with torch.inference_mode():
            o, lg = mtp(hidden[a:b], fb, pool)
        outs.append(o)
        logits.append(lg)
    return torch.cat(outs), torch.cat(logits)


def test_mtp_forward_matches_the_reference(preset, hf_deeper):
    cfg = model_config_of(preset)
    assert cfg.num_nextn_predict_layers == 1
    w = load_file(str(preset / "model.safetensors"))
    ids = [cfg.bos_token_id or 0, *prompt_ids(30, seed=5, vocab=cfg.vocab_size)]
    with torch.no_grad():  # the target's hidden states, after the final norm (the MTP's h_i)
        hidden = hf_deeper.model.norm(
            hf_deeper.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[cfg.num_layers][0]
        )
    h, nxt = hidden[:-1], ids[1:]  # position i: h_i and t_{i+1}
    want_out, want_logits = reference_mtp(hf_deeper, w, h, nxt, cfg.rms_norm_eps)
    mtp = load_mtp(preset, cfg)
    shape = Shape(cfg.num_layers + 1, cfg.hidden_size)
    n = len(nxt)
    # a whole extend; an extend, a chunk behind it, then single-token decode steps (the chain)
    for cuts in ([0, n], [0, 11, 20, *range(21, n + 1)]):
        out, logits = run_mtp(mtp, mtp_pool(cfg, 16), h, nxt, cuts)
        assert_close_logits(logits, want_logits, shape, n, msg=f"MTP logits, pieces {cuts[:4]}..")
        assert_close_logits(out, want_out, shape, n, msg="MTP output hidden states")
    # the output is what the next chain step feeds back: a wrong hidden input changes the logits
    _, wrong = run_mtp(mtp, mtp_pool(cfg, 16), torch.roll(h, 1, dims=0), nxt, [0, n])
    assert (wrong - want_logits).abs().max() > 100 * (logits - want_logits).abs().max()


def test_runner_captures_the_post_norm_hidden_states(preset, hf_deeper):
    """ModelRunner.capture_hidden keeps the last layer's output after the final norm, every row:
    HF's hidden state after layer num_layers, through model.norm."""
    cfg = model_config_of(preset)
    runner = ModelRunner(load_model(preset), CacheConfig(page_size=PAGE, num_pages=16))
    runner.capture_hidden = True
    ids = [cfg.bos_token_id or 0, *prompt_ids(13, seed=2, vocab=cfg.vocab_size)]
    runner.run(ForwardSpec((ids,), (0,), (np.arange(4, dtype=np.int64),), (True,)))
    got = runner.take_hidden()
    with torch.no_grad():
        hs = hf_deeper.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[cfg.num_layers][0]
        want = hf_deeper.model.norm(hs)
    assert_close_logits(got, want, cfg, len(ids), msg="captured hidden states")
    with pytest.raises(RuntimeError, match="no hidden states"):
        runner.take_hidden()  # handed over once


def test_mtp_layer_index_and_shared_weights(preset, tmp_path):
    """A checkpoint without the MTP's embed_tokens / shared_head.head copies uses the target's
    (SGLang always does); a config without MTP layers has none to load."""
    cfg = model_config_of(preset)
    mtp = load_mtp(preset, cfg)
    w = load_file(str(preset / "model.safetensors"))
    # the preset writes copies of the target's tensors, as the hub checkpoint does
    assert torch.equal(w[MTP_LAYER + "embed_tokens.weight"], w["model.embed_tokens.weight"])
    assert torch.equal(w[MTP_LAYER + "shared_head.head.weight"], w["lm_head.weight"])
    assert mtp.embed_tokens is not None and mtp.shared_head.head is not None
    with pytest.raises(ConfigError, match="no multi-token-prediction layer 1"):
        load_mtp(preset, cfg, index=1)
