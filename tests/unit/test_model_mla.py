"""DeepSeek-V3 multi-head latent attention against HF transformers, fp32: the attention module,
the absorbed decode against the expanded form, yarn RoPE, whole models over the latent paged cache
(full prompt, chunked prefill, paged decode, greedy generation), the TP config checks and the
tiny-deepseek-v3 preset."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.mla import MLAttention, mla_softmax_scale
from kvpipe.model.layers.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq, rope_type
from kvpipe.model.presets import write_preset
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.paged_model import all_logits, greedy_generate, incremental_logits, make_pool
from tests.helpers.tolerance import assert_close_logits

# transformers comes with the `test` extra: without it this module is skipped, not failed, so the
# helpers that build HF models are imported after the check
transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale  # noqa: E402

from tests.helpers.hf_deepseek_v3 import CASES, YARN, hf_mla_model  # noqa: E402
from tests.helpers.hf_models import hf_logits, hf_model, prompt_ids, save  # noqa: E402


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    hf = hf_mla_model(**CASES[request.param])
    return hf, load_model(save(hf, tmp_path_factory.mktemp(request.param)))


# ---- RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        YARN,
        {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "factor": 40.0},  # DeepSeek-V3's own: attention_factor 1
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "rope_theta": 500.0},
        {
            "rope_type": "yarn",
            "factor": 3.0,
            "original_max_position_embeddings": 128,
            "truncate": False,
            "beta_fast": 16,
            "beta_slow": 2,
            "rope_theta": 10000.0,
        },
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 0.9,
            "rope_theta": 10000.0,
        },
    ],
)
@pytest.mark.parametrize("rope_dim", [8, 64])
def test_yarn_matches_transformers(params, rope_dim):
    cfg = transformers.DeepseekV3Config(
        qk_rope_head_dim=rope_dim, max_position_embeddings=256, rope_parameters=dict(params)
    )
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    got = rope_inv_freq(rope_dim, params["rope_theta"], scaling, 256)
    assert got.dtype == torch.float32 and torch.equal(got, want_inv_freq)
    assert rope_attention_factor(scaling, 256) == want_factor
    want_scale = yarn_apply_mscale(cfg.rope_parameters, cfg.qk_head_dim ** (-0.5))  # DeepseekV3Attention.scaling
    assert mla_softmax_scale(cfg.qk_head_dim, scaling) == want_scale


def test_existing_rope_types_keep_factor_one():
    for scaling in (None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "llama3", "factor": 8.0}):
        assert rope_attention_factor(scaling) == 1.0


def test_llama_with_yarn_matches_hf(tmp_path):
    """yarn's cos/sin attention_factor applies to every family, not only MLA."""
    hf = hf_model(
        "llama",
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0,
        },
    )
    ours = load_model(save(hf, tmp_path / "llama_yarn"))
    assert ours.rope_attention_factor > 1.0
    ids = prompt_ids(40, seed=11)
    got = incremental_logits(ours, ids, prompt_len=17, page_size=4, chunk=6)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


# ---- the attention module ----------------------------------------------------------------------


def _module_inputs(ours, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_attention_module_matches_hf(case):
    hf, ours = case
    x = _module_inputs(ours, 11, seed=1)
    pos = torch.arange(11)
    cos, sin = hf.model.rotary_emb(x[None], pos[None])
    want, _ = hf.model.layers[1].self_attn(hidden_states=x[None], position_embeddings=(cos, sin), attention_mask=None)
    attn = ours.layers[1].self_attn
    assert isinstance(attn, MLAttention)
    c, s = rope_cos_sin(ours.inv_freq, pos, x.dtype, ours.rope_attention_factor)
    torch.testing.assert_close(c, cos[0], atol=0, rtol=0)
    batch = ForwardBatch.build([list(range(11))], [0], [torch.tensor([2, 0, 1])], 4)
    pool = make_pool(ours, 3, 4)
    got = attn(x, c, s, batch, pool)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=0)
    # the cache holds [normalised compressed kv | rotated k_rope] per token, one "head"
    assert pool.k[1].shape == (3, 1, 4, 16 + 8) and pool.v == []


@torch.no_grad()
def test_absorbed_decode_equals_expanded(case):
    """A batched decode step (absorbed, over the latent pages) against the same rows run through
    the expanded prefix path (DecodeIndex removed), rows of different lengths."""
    _, ours = case
    attn, page = ours.layers[0].self_attn, 4
    lens = [9, 3, 14]
    tables = [torch.tensor([7, 1, 4]), torch.tensor([0]), torch.tensor([2, 9, 5, 3])]
    pool = make_pool(ours, 10, page)
    for i, (n, table) in enumerate(zip(lens, tables)):  # prefixes, written by prefills
        batch = ForwardBatch.build([list(range(n))], [0], [table], page)
        cos, sin = rope_cos_sin(ours.inv_freq, batch.positions, torch.float32, ours.rope_attention_factor)
        attn(_module_inputs(ours, n, seed=10 + i), cos, sin, batch, pool)
    step = ForwardBatch.build([[1], [2], [3]], lens, tables, page)
    assert step.decode is not None
    cos, sin = rope_cos_sin(ours.inv_freq, step.positions, torch.float32, ours.rope_attention_factor)
    x = _module_inputs(ours, 3, seed=20)
    absorbed = attn(x, cos, sin, step, pool)
    expanded = attn(x, cos, sin, dataclasses.replace(step, decode=None), pool)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=0)


# ---- whole models over the latent paged cache ----------------------------------------------------


def test_full_prompt_logits_match_hf(case):
    hf, ours = case
    assert ours.cfg.mla is not None and ours.local_kv_heads == 1
    want_mlps = ["MLP" if i in ours.cfg.moe.dense_layers else "SparseMoE" for i in range(ours.num_layers)]
    assert [type(layer.mlp).__name__ for layer in ours.layers] == want_mlps
    ids = prompt_ids(37)
    got = ours(all_logits(ForwardBatch.build([ids], [0], [torch.arange(10)], 4)), make_pool(ours, 10, 4))
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


@pytest.mark.parametrize("chunk", [None, 3, 5])
def test_chunked_prefill_and_paged_decode_match_hf(case, chunk):
    hf, ours = case
    ids = prompt_ids(30, seed=2)
    # prompt of 13 tokens over pages of 4, in chunks that do not divide the page; 17 decode steps
    got = incremental_logits(ours, ids, prompt_len=13, page_size=4, chunk=chunk)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


def test_packed_batches_match_hf(case):
    """A decode row next to a prefill row in one forward, then a batched decode of both rows."""
    hf, ours = case
    a, b = prompt_ids(12, seed=3), prompt_ids(8, seed=4)
    pool = make_pool(ours, 12, 3)
    ta, tb = torch.tensor([5, 2, 9, 0]), torch.tensor([7, 1, 11])
    ours(ForwardBatch.build([a[:10]], [0], [ta], 3), pool)
    mixed = ours(all_logits(ForwardBatch.build([a[10:11], b[:7]], [10, 0], [ta, tb], 3)), pool)
    assert_close_logits(mixed[:1], hf_logits(hf, a[:11])[10:], ours.cfg, 11)
    assert_close_logits(mixed[1:], hf_logits(hf, b[:7]), ours.cfg, 7)
    step = ForwardBatch.build([a[11:], b[7:]], [11, 7], [ta, tb], 3)
    assert step.decode is not None
    got = ours(step, pool)
    assert_close_logits(got[0], hf_logits(hf, a)[-1], ours.cfg, len(a))
    assert_close_logits(got[1], hf_logits(hf, b)[-1], ours.cfg, len(b))


def test_greedy_generation_matches_hf_generate(case):
    hf, ours = case
    prompt = prompt_ids(10, seed=6)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    assert len(want) == 32
    assert greedy_generate(ours, prompt, 32, page_size=4) == want


def test_mtp_layers_are_ignored(tmp_path):
    """A checkpoint with a multi-token-prediction layer (model.layers.<num_hidden_layers>.*) loads."""
    hf = hf_mla_model(num_hidden_layers=2, first_k_dense_replace=2)
    path = save(hf, tmp_path / "mtp")
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if ".layers.1." in k})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(path)
    assert ours.num_layers == 2
    ids = prompt_ids(9, seed=7)
    got = ours(all_logits(ForwardBatch.build([ids], [0], [torch.arange(3)], 4)), make_pool(ours, 3, 4))
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "'dynamic'"),
    ],
)
def test_unsupported_deepseek_options(tmp_path, changes, match):
    path = save(hf_mla_model(num_hidden_layers=1, first_k_dense_replace=1), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))
    with pytest.raises(ConfigError, match=match):
        load_model(path)


def test_tp_rejects_indivisible_heads(tmp_path):
    path = save(hf_mla_model(num_hidden_layers=1, first_k_dense_replace=1), tmp_path / "m")
    with pytest.raises(ConfigError, match="tp_size=3"):
        load_model(path, ParallelConfig(3, 0))


# ---- the tiny-deepseek-v3 preset -------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek_preset_dir(tmp_path_factory) -> Path:
    return write_preset("tiny-deepseek-v3", tmp_path_factory.mktemp("tiny_deepseek_v3"))


def test_deepseek_preset_shape(deepseek_preset_dir):
    cfg = model_config_of(deepseek_preset_dir)
    mla, moe = cfg.mla, cfg.moe
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads) == ("deepseek_v3", 4, 128, 8)
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.rope_interleave) == (64, 32, 16, True)
    assert (cfg.kv_cache_heads, cfg.kv_cache_head_dim, cfg.kv_buffers_per_layer) == (1, 48, 1)
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups, moe.dense_layers) == (8, 2, 2, 1, (0,))
    assert moe.shared_intermediate_size == moe.expert_intermediate_size == 64
    assert rope_type(cfg.rope_scaling) == "yarn"
    assert cfg.vocab_size == Tokenizer.from_dir(deepseek_preset_dir).vocab_size
    again = write_preset("tiny-deepseek-v3", deepseek_preset_dir.parent / "again")
    for f in ("config.json", "model.safetensors", "kvpipe_preset.json"):
        assert (again / f).read_bytes() == (deepseek_preset_dir / f).read_bytes()


def test_deepseek_preset_matches_hf(deepseek_preset_dir):
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(deepseek_preset_dir, dtype=torch.float32).eval()
    ours = load_model(deepseek_preset_dir)
    ids = [ours.cfg.bos_token_id or 0, *prompt_ids(24, seed=8)]
    got = incremental_logits(ours, ids, prompt_len=11, page_size=4, chunk=6)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))
    tok = Tokenizer.from_dir(deepseek_preset_dir)
    out = greedy_generate(ours, tok.encode("the cat and the dog"), 32, page_size=8)
    assert len(set(out)) >= 4, out  # a random model that does not echo one token
