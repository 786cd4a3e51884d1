"""Qwen3.5's multi-token-prediction layer (kvpipe/model/draft/qwen3_5_mtp.py) against a reference on
the same weights, fp32, on the tiny-qwen3.5 and tiny-qwen3.5-moe presets. transformers implements
no Qwen3.5 MTP (its models skip the checkpoint's mtp.* tensors on load), so the reference is
plain torch for the MTP's own parts (the zero-centred pre-fc norms, fc) and, for its decoder
layer and final norm, HF's Qwen3.5 model built one full-attention layer deep from the mtp.*
tensors (mtp.layers.0. as model.layers.0., mtp.norm as model.norm). The MTP runs over its own
one-layer paged K/V pool as the drafter runs it: an extend, a chunk behind it, then single-token
steps. The preset's norm weights are zero (a scale of 1): the test's copy draws them at random,
so a norm that scales by w instead of (1 + w) fails. Also: the presets' target tensors are those
of the same preset without an MTP layer, and the runner's captured hidden states are HF's."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import CacheConfig, ConfigError
from kvpipe.engine.batch import ForwardSpec
from kvpipe.engine.model_runner import ModelRunner
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.draft.mtp import load_mtp
from kvpipe.model.draft.mtp_layer import MTPLayer
from kvpipe.model.draft.qwen3_5_mtp import Qwen3_5MTP
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.presets import write_preset
from kvpipe.model.presets.qwen3_5 import QWEN3_5_PRESETS, weights
from tests.helpers.hf_models import prompt_ids
from tests.helpers.paged_model import all_logits
from tests.helpers.tolerance import assert_close_logits

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

PAGE = 4
HF_CLASSES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


@dataclass(frozen=True)
class Shape:
    """The depth the hidden states went through: the target's layers and the MTP's."""

    num_layers: int
    hidden_size: int


@pytest.fixture(scope="module", params=["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def preset(request, tmp_path_factory) -> Path:
    """The preset with its norm weights drawn at random (target's and MTP's)."""
    path = write_preset(request.param, tmp_path_factory.mktemp(request.param.replace(".", "_")))
    w = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for name, t in w.items():
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w[name] = 0.3 * torch.randn(t.shape, generator=g)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def hf_class(cfg: ModelConfig):
    return getattr(transformers, HF_CLASSES[cfg.architecture])


def hf_mtp_decoder(preset: Path, out: Path):
    """HF's Qwen3.5 with one full-attention layer: the MTP's decoder layer and final norm (and the
    target's embedding and lm_head, unused here)."""
    raw = json.loads((preset / "config.json").read_text())
    raw |= {"num_hidden_layers": 1, "layer_types": ["full_attention"]}
    raw.pop("mtp_num_hidden_layers")
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    w = load_file(str(preset / "model.safetensors"))
    one = {n: t for n, t in w.items() if n in ("model.embed_tokens.weight", "lm_head.weight")}
    one |= {"model." + n.removeprefix("mtp."): t for n, t in w.items() if n.startswith("mtp.layers.0.")}
    one["model.norm.weight"] = w["mtp.norm.weight"]
    save_file(one, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model_config_of(preset)
    return hf_class(cfg).from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()


def zrms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: scale by (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


@torch.no_grad()
def reference_mtp(preset: Path, decoder, hidden: torch.Tensor, next_ids: list[int], eps: float):
    """SGLang's Qwen3.5 MTP over positions 0 .. L-1: h_i [L, H] and t_{i+1} -> (out [L, H], logits [L, V])."""
    w = load_file(str(preset / "model.safetensors"))
    e = zrms(w["model.embed_tokens.weight"][torch.tensor(next_ids)], w["mtp.pre_fc_norm_embedding.weight"], eps)
    x = torch.cat([e, zrms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1) @ w["mtp.fc.weight"].T
    out = decoder.model(inputs_embeds=x[None]).last_hidden_state[0]
    return out, out @ w["lm_head.weight"].T


def run_mtp(mtp: MTPLayer, pool: KVPool, hidden: torch.Tensor, next_ids: list[int], cuts: list[int]):
    """The MTP over positions 0 .. L-1 in pieces [cuts[i], cuts[i+1]) on one scattered page table,
    every row's logits -> (out [L, H], logits [L, V])."""
    table = torch.randperm(pool.num_pages, generator=torch.Generator().manual_seed(2))
    outs, logits = [], []
    for a, b in zip(cuts, cuts[1:]):
        fb = all_logits(ForwardBatch.build([next_ids[a:b]], [a], [table[: -(-b // PAGE)]], PAGE))
        with torch.inference_mode():
            o, lg = mtp(hidden[a:b], fb, pool)
        outs.append(o)
        logits.append(lg)
    return torch.cat(outs), torch.cat(logits)


def test_mtp_forward_matches_the_reference(preset, tmp_path):
    cfg = model_config_of(preset)
    assert cfg.num_nextn_predict_layers == 1 and cfg.hybrid is not None
    target = hf_class(cfg).from_pretrained(preset, dtype=torch.float32).eval()
    ids = [cfg.bos_token_id or 0, *prompt_ids(30, seed=5, vocab=cfg.vocab_size)]
    with torch.no_grad():  # the target's hidden states, after its final norm (the MTP's h_i)
        hidden = target.model(torch.tensor([ids])).last_hidden_state[0]
    h, nxt = hidden[:-1], ids[1:]  # position i: h_i and t_{i+1}
    want_out, want_logits = reference_mtp(
        preset, hf_mtp_decoder(preset, tmp_path / "decoder"), h, nxt, cfg.rms_norm_eps
    )
    mtp = load_mtp(preset, cfg)
    assert isinstance(mtp, Qwen3_5MTP) and mtp.embed_tokens is None and mtp.own_head is None
    ours = load_model(preset)
    assert ours.lm_head is not None
    mtp.set_target(ours.embed_tokens, ours.lm_head)  # shared with the target, as SGLang does
    shape = Shape(cfg.num_layers + 1, cfg.hidden_size)
    n = len(nxt)
    # a whole extend; an extend, a chunk behind it, then single-token decode steps (the chain)
    for cuts in ([0, n], [0, 11, 20, *range(21, n + 1)]):
        pool = mtp.kv_pool(16, PAGE, "cpu")
        assert (pool.num_layers, pool.kv_heads, pool.head_dim) == (1, cfg.num_kv_heads, cfg.head_dim)
        out, logits = run_mtp(mtp, pool, h, nxt, cuts)
        assert_close_logits(logits, want_logits, shape, n, msg=f"MTP logits, pieces {cuts[:4]}..")
        assert_close_logits(out, want_out, shape, n, msg="MTP output hidden states")
    # the hidden input matters: a wrong one changes the logits far beyond the tolerance
    _, wrong = run_mtp(mtp, mtp.kv_pool(16, PAGE, "cpu"), torch.roll(h, 1, dims=0), nxt, [0, n])
    assert (wrong - want_logits).abs().max() > 100 * (logits - want_logits).abs().max()


def test_runner_captures_the_post_norm_hidden_states(preset):
    """ModelRunner.capture_hidden on a hybrid target: HF's last hidden state (after model.norm)."""
    cfg = model_config_of(preset)
    runner = ModelRunner(load_model(preset), CacheConfig(page_size=PAGE, num_pages=16))
    runner.capture_hidden = True
    ids = [cfg.bos_token_id or 0, *prompt_ids(13, seed=2, vocab=cfg.vocab_size)]
    runner.run(ForwardSpec((ids,), (0,), (np.arange(4, dtype=np.int64),), (True,), state_slots=(0,)))
    got = runner.take_hidden()
    target = hf_class(cfg).from_pretrained(preset, dtype=torch.float32).eval()
    with torch.no_grad():
        want = target.model(torch.tensor([ids])).last_hidden_state[0]
    assert_close_logits(got, want, cfg, len(ids), msg="captured hidden states")


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_the_mtp_layer_leaves_the_target_tensors_as_they_were(name):
    """The MTP's tensors are drawn after every target tensor: the target's are bit-identical to
    a preset without an MTP layer's, and the MTP's are Qwen3.5's hub names (no embedding or head
    copies: shared with the target)."""
    spec = QWEN3_5_PRESETS[name]
    assert spec.mtp_layers == 1
    with_mtp, without = weights(spec, 300, 0), weights(replace(spec, mtp_layers=0), 300, 0)
    assert set(without) == {n for n in with_mtp if not n.startswith("mtp.")}
    assert all(torch.equal(with_mtp[n], t) for n, t in without.items())
    own = {n for n in with_mtp if n.startswith("mtp.") and not n.startswith("mtp.layers.0.")}
    assert own == {
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    }
    layer = {n.removeprefix("mtp.layers.0.") for n in with_mtp if n.startswith("mtp.layers.0.")}
    full = next(i for i, t in enumerate(spec.layer_types) if t == "full_attention")
    assert layer == {n.removeprefix(f"model.layers.{full}.") for n in without if n.startswith(f"model.layers.{full}.")}


def test_a_checkpoint_without_mtp_tensors_is_refused(tmp_path):
    """mtp_num_hidden_layers without the tensors: the loader names what is missing."""
    path = write_preset("tiny-qwen3.5", tmp_path / "m")
    w = {n: t for n, t in load_file(str(path / "model.safetensors")).items() if n != "mtp.fc.weight"}
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="mtp.fc.weight"):
        load_mtp(path, model_config_of(path))
