"""Logits and greedy generations of kvpipe's CausalLM against HF transformers, fp32."""

from __future__ import annotations

import pytest
import torch

from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.forward_batch import ForwardBatch
from tests.helpers.paged_model import all_logits, greedy_generate, incremental_logits, make_pool
from tests.helpers.tolerance import assert_close_logits

# transformers comes with the `test` extra: without it this module is skipped, not failed, so the
# helpers that build HF models are imported after the check
transformers = pytest.importorskip("transformers")

from tests.helpers.hf_models import VOCAB, hf_logits, hf_model, prompt_ids, save  # noqa: E402

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    # GQA, untied, llama3 frequency scaling (wavelengths on both sides of the smoothing band)
    "llama_gqa_llama3": ("llama", dict(num_key_value_heads=2, rope_scaling=LLAMA3_SCALING, rope_theta=500.0)),
    # MHA, tied embeddings, linear position interpolation
    "llama_mha_tied_linear": (
        "llama",
        dict(num_key_value_heads=4, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "qwen2_gqa_tied_bias": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_gqa_qknorm": ("qwen3", dict(num_key_value_heads=1, head_dim=24, tie_word_embeddings=False)),
    # 8 experts top-2, softmax routing without renormalisation; layer 1 keeps a dense MLP
    "qwen3_moe_dense_layer": ("qwen3_moe", dict(num_key_value_heads=2, mlp_only_layers=[1])),
    # sigmoid routing steered by a random correction bias, q/k norms over all heads, partial rotary
    "minimax_m2_partial_rotary": ("minimax_m2", dict(num_key_value_heads=2, head_dim=24, rotary_dim=8)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    hf = hf_model(family, **overrides)
    return hf, load_model(save(hf, tmp_path_factory.mktemp(request.param)))


def test_full_prompt_logits_match_hf(case):
    hf, ours = case
    ids = prompt_ids(37)
    batch = all_logits(ForwardBatch.build([ids], [0], [torch.arange(10)], 4))
    got = ours(batch, make_pool(ours, 10, 4))
    assert got.dtype == torch.float32 and got.shape == (37, VOCAB)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


@pytest.mark.parametrize("chunk", [None, 3, 5])
def test_paged_decode_matches_hf(case, chunk):
    hf, ours = case
    ids = prompt_ids(30, seed=2)
    # prompt of 13 tokens over pages of 4 (13 % 4 != 0), then 17 single-token decode steps
    got = incremental_logits(ours, ids, prompt_len=13, page_size=4, chunk=chunk)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


def test_packed_batch_of_sequences_matches_hf(case):
    """Two sequences in one forward: a decode step of one next to a prefill of the other."""
    hf, ours = case
    a, b = prompt_ids(11, seed=3), prompt_ids(7, seed=4)
    pool = make_pool(ours, 12, 3)
    ta, tb = torch.tensor([5, 2, 9, 0]), torch.tensor([7, 1, 11])
    ours(ForwardBatch.build([a[:10]], [0], [ta], 3), pool)
    batch = ForwardBatch.build([a[10:], b], [10, 0], [ta, tb], 3)
    got = ours(all_logits(batch), pool)
    assert_close_logits(got[:1], hf_logits(hf, a)[10:], ours.cfg, len(a))
    assert_close_logits(got[1:], hf_logits(hf, b), ours.cfg, len(b))


def test_layer_groups_equal_full_forward(case):
    _, ours = case
    ids = prompt_ids(9, seed=5)
    batch = ForwardBatch.build([ids], [0], [torch.arange(3)], 4)
    pool_a, pool_b = make_pool(ours, 3, 4), make_pool(ours, 3, 4)
    full = ours(batch, pool_a)
    h = ours.embed(batch)
    for start, end in [(0, 1), (1, 1), (1, 3)]:
        h = ours.forward_layers(h, batch, pool_b, start, end)
    assert torch.equal(ours.compute_logits(h, batch), full)
    for layer in range(ours.num_layers):
        assert torch.equal(pool_a.k[layer], pool_b.k[layer]) and torch.equal(pool_a.v[layer], pool_b.v[layer])
    with pytest.raises(ValueError):
        ours.forward_layers(h, batch, pool_b, 2, 4)


def test_greedy_generation_matches_hf_generate(case):
    hf, ours = case
    prompt = prompt_ids(10, seed=6)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    assert len(want) == 32
    assert greedy_generate(ours, prompt, 32, page_size=4) == want


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("qwen3", num_key_value_heads=2)
    path = save(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    ours = load_model(path)
    ids = prompt_ids(12, seed=7)
    got = ours(all_logits(ForwardBatch.build([ids], [0], [torch.arange(3)], 4)), make_pool(ours, 3, 4))
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


def test_tiny_preset_matches_hf(tiny_model_dir):
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ours = load_model(tiny_model_dir)
    ids = [ours.cfg.bos_token_id or 0, *prompt_ids(20, seed=8)]
    got = incremental_logits(ours, ids, prompt_len=9, page_size=4)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


def test_bf16_load_keeps_rope_in_fp32(tiny_model_dir):
    ours = load_model(tiny_model_dir, dtype="bfloat16")
    assert ours.embed_tokens.dtype == torch.bfloat16 and ours.inv_freq.dtype == torch.float32
    ids = prompt_ids(6, seed=9)
    ref = load_model(tiny_model_dir)
    batch = ForwardBatch.build([ids], [0], [torch.arange(2)], 4)
    got = ours(batch, make_pool(ours, 2, 4))
    assert got.dtype == torch.float32
    want = ref(batch, make_pool(ref, 2, 4))
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # same model, bf16 rounding only
