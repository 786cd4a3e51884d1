"""Qwen3.5-MoE text model (the Qwen3.5 hybrid stack with a sparse MoE MLP and a sigmoid-gated
shared expert) against HF transformers, fp32: whole-prompt logits, chunked prefill, paged decode,
greedy generation; config parsing and the options kvpipe refuses; the tiny preset."""

from __future__ import annotations

import json

import pytest
import torch

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.families.qwen3_5 import Qwen3_5CausalLM
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.moe import SparseMoE
from kvpipe.model.presets import preset_names, write_preset
from tests.helpers.paged_model import all_logits
from tests.helpers.preset_digests import digests
from tests.helpers.tolerance import assert_close_logits, logits_close

# transformers (the `test` extra) with Qwen3.5-MoE: without them this module is skipped, not
# failed, so the helpers that build HF models are imported after the check
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5_moe")

from tests.helpers.hf_models import VOCAB, hf_logits, prompt_ids, save  # noqa: E402
from tests.helpers.hybrid_model import F, L, greedy_generate, hf_qwen3_5_moe, incremental_logits, pools  # noqa: E402

CASES = {
    "mixed": dict(),
    # two full layers, tied embeddings, top-1 routing (renormalised to weight 1)
    "tied_top1": dict(num_hidden_layers=3, layer_types=[F, L, F], tie_word_embeddings=True, num_experts_per_tok=1),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    hf = hf_qwen3_5_moe(**CASES[request.param])
    return hf, load_model(save(hf, tmp_path_factory.mktemp(request.param)))


def test_config_parsed(case):
    hf, ours = case
    cfg, moe = ours.cfg, ours.cfg.moe
    assert isinstance(ours, Qwen3_5CausalLM) and cfg.architecture == "qwen3_5_moe" and cfg.hybrid is not None
    assert [t.value for t in cfg.hybrid.layer_types] == hf.config.layer_types
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.shared_intermediate_size) == (
        8,
        hf.config.num_experts_per_tok,
        24,
        40,
    )
    assert moe.scoring == "softmax" and moe.norm_topk_prob and moe.shared_expert_gate and not moe.dense_layers
    assert all(isinstance(layer.mlp, SparseMoE) for layer in ours.layers)


def test_full_prompt_logits_match_hf(case):
    hf, ours = case
    ids = prompt_ids(77)
    kv, state = pools(ours, 20, 4)
    got = ours(all_logits(ForwardBatch.build([ids], [0], [torch.arange(20)], 4, state_slots=[1])), kv, state)
    assert got.shape == (77, VOCAB)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


@pytest.mark.parametrize("chunk", [None, 1, 3, 70])
def test_chunked_prefill_and_paged_decode_match_hf(case, chunk):
    """A 75-token prompt over pages of 4 in chunks that do not divide the page size, then decode."""
    hf, ours = case
    ids = prompt_ids(90, seed=2)
    got = incremental_logits(ours, ids, prompt_len=75, page_size=4, chunk=chunk)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


def test_greedy_generation_matches_hf_generate(case):
    hf, ours = case
    prompt = prompt_ids(10, seed=9)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    assert len(want) == 32
    assert greedy_generate(ours, prompt, 32, page_size=4) == want


def test_shared_expert_gate_matters(tmp_path):
    """The gate is read and applied: zeroing it (sigmoid 0.5) changes the logits."""
    hf = hf_qwen3_5_moe(seed=1)
    ours = load_model(save(hf, tmp_path / "m"))
    ids = prompt_ids(9, seed=3)
    assert_close_logits(incremental_logits(ours, ids, 9, 4), hf_logits(hf, ids), ours.cfg, len(ids))
    with torch.no_grad():
        for layer in ours.layers:
            gate = layer.mlp.shared_expert_gate
            (gate.panel.panels if gate.panel is not None else gate.weight).zero_()  # the weight as loaded
    assert not logits_close(incremental_logits(ours, ids, 9, 4), hf_logits(hf, ids), ours.cfg, len(ids))


@pytest.mark.parametrize(
    "key, value",
    [
        ("decoder_sparse_step", 2),
        ("mlp_only_layers", [0]),
        ("norm_topk_prob", False),
        ("shared_expert_intermediate_size", 0),
        ("hidden_act", "gelu"),
    ],
)
def test_unsupported_options_are_refused(tmp_path, key, value):
    path = save(hf_qwen3_5_moe(num_hidden_layers=2, layer_types=[L, F]), tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw[key] = value
    (path / "config.json").write_text(json.dumps(raw))
    assert model_config_of(path).architecture == "qwen3_5_moe"
    with pytest.raises(ConfigError, match=key):
        load_model(path)


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory):
    return write_preset("tiny-qwen3.5-moe", tmp_path_factory.mktemp("tiny_qwen35_moe"))


def test_tiny_qwen3_5_moe_preset_matches_hf(preset_dir, tmp_path):
    assert "tiny-qwen3.5-moe" in preset_names()
    assert digests(write_preset("tiny-qwen3.5-moe", tmp_path / "again")) == digests(preset_dir)
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(preset_dir, dtype=torch.float32).eval()
    ours = load_model(preset_dir)
    assert ours.cfg.architecture == "qwen3_5_moe" and ours.cfg.hybrid.full_layers == (3,)
    ids = [ours.cfg.bos_token_id, *prompt_ids(30, seed=11)]
    assert_close_logits(incremental_logits(ours, ids, 20, 8, chunk=7), hf_logits(hf, ids), ours.cfg, len(ids))
    out = greedy_generate(ours, ids[:12], 24, page_size=8)
    assert len(set(out)) >= 4, out  # not a degenerate model
