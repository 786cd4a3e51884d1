"""GPT-OSS against HF transformers, fp32: sliding-window and full layers, attention sinks, the
top-k-softmax MoE with biased fused experts and clamped SwiGLU, yarn RoPE (truncate=false); the
three attention paths (whole prompt, chunks behind a cached prefix, batched paged decode past the
window), TP 2/4, the config checks and the tiny-gpt-oss preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

from model_utils import all_logits, greedy_generate, hf_logits, incremental_logits, make_pool, prompt_ids, save  # noqa: E402
from test_model_tp import _run, _worker  # noqa: E402

from kvpipe.config import ConfigError, ParallelConfig  # noqa: E402
from kvpipe.model.config import ModelConfig
from kvpipe.model.forward_batch import ForwardBatch  # noqa: E402
from kvpipe.model.loader import load_model  # noqa: E402
from kvpipe.model.presets import write_preset  # noqa: E402
from kvpipe.model.tokenizer import Tokenizer  # noqa: E402

ATOL = 1e-4
VOCAB = 160  # = model_utils.VOCAB, which prompt_ids draws from
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
CASES = {
    # HF's default pattern (sliding, full, ...), window 8, GQA, biases on q/k/v/o
    "alternating_gqa": dict(num_hidden_layers=4, num_key_value_heads=2, sliding_window=8),
    # full first, then two sliding layers of window 5; MHA, no attention biases, top-3 routing
    "custom_layers_mha": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        attention_bias=False,
        num_experts_per_tok=3,
    ),
}


def hf_gpt_oss(seed: int = 0, **overrides):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        head_dim=16,
        num_attention_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        rope_parameters=YARN,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # HF inits sinks small and expert biases to zero: make both matter
            if name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif name.endswith("_bias") or name.endswith("proj.bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    hf = hf_gpt_oss(**CASES[request.param])
    return hf, load_model(save(hf, tmp_path_factory.mktemp(request.param)))


def test_config_fields(case):
    hf, ours = case
    cfg = ours.cfg
    assert cfg.architecture == "gpt_oss" and cfg.attention_sinks
    assert cfg.sliding_layers == tuple(i for i, t in enumerate(hf.config.layer_types) if t == "sliding_attention")
    assert cfg.sliding_window == hf.config.sliding_window and cfg.o_proj_bias == hf.config.attention_bias
    assert cfg.moe.scoring == "topk_softmax" and (cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) == (1.702, 7.0)


def test_full_prompt_logits_match_hf(case):
    hf, ours = case
    ids = prompt_ids(37)  # several windows long
    batch = all_logits(ForwardBatch.build([ids], [0], [torch.arange(10)], 4))
    torch.testing.assert_close(ours(batch, make_pool(ours, 10, 4)), hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [None, 3, 5, 7])
def test_chunked_prefill_and_decode_past_window_match_hf(case, chunk):
    """A 13-token prompt over pages of 4 in chunks that do not divide the page, then 27 decode
    steps: the sliding layers' windows move past the first pages."""
    hf, ours = case
    ids = prompt_ids(40, seed=2)
    got = incremental_logits(ours, ids, prompt_len=13, page_size=4, chunk=chunk)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_batched_decode_rows_of_different_lengths_match_hf(case):
    """One decode forward over three rows: shorter than, equal to and longer than the window."""
    hf, ours = case
    seqs = [prompt_ids(n, seed=10 + n) for n in (4, hf.config.sliding_window, 23)]
    pool = make_pool(ours, 20, 3)
    tables, start = [], 0
    for s in seqs:
        n = -(-len(s) // 3)
        tables.append(torch.arange(start, start + n).flip(0))  # scattered, descending pages
        start += n
        ours(ForwardBatch.build([s[:-1]], [0], [tables[-1]], 3), pool)
    batch = ForwardBatch.build([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], tables, 3)
    assert batch.decode is not None
    got = ours(batch, pool)
    for row, s in zip(got, seqs):
        torch.testing.assert_close(row, hf_logits(hf, s)[-1], atol=ATOL, rtol=0)


def test_greedy_generation_matches_hf_generate(case):
    hf, ours = case
    prompt = prompt_ids(10, seed=6)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    assert len(want) == 32
    assert greedy_generate(ours, prompt, 32, page_size=4) == want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_tp1(world, tmp_path):
    """Heads, KV heads (replicated at tp 4), sinks and experts' intermediate dim sliced; greedy
    tokens and logits of tp=1 (test_model_tp's harness: 13-token prompt in chunks of 5, decode
    past the window of 8, 32 greedy tokens)."""
    d = str(save(hf_gpt_oss(**CASES["alternating_gqa"]), tmp_path / "model"))
    mp.spawn(
        _worker, args=(world, str(tmp_path / "rendezvous"), {"gpt_oss": d}, str(tmp_path)), nprocs=world, join=True
    )
    want_logits, _, want_greedy = _run(Path(d), ParallelConfig())
    for rank in range(world):
        got = torch.load(tmp_path / f"gpt_oss-{rank}.pt")
        assert got["greedy"] == want_greedy, f"rank {rank}"
        torch.testing.assert_close(got["logits"], want_logits, atol=1e-5, rtol=0, msg=f"rank {rank}")


def _config(tmp_path: Path, **changes) -> Path:
    path = save(hf_gpt_oss(num_hidden_layers=2, sliding_window=4), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | changes))
    return path


def test_mxfp4_checkpoint_is_refused(tmp_path):
    """Hub GPT-OSS checkpoints store the experts in MXFP4 (quantization_config): refused."""
    path = _config(tmp_path, quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ConfigError, match="quantized checkpoints are not supported.*mxfp4"):
        load_model(path)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(layer_types=["sliding_attention", "chunked_attention"]), "unsupported layer types"),
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
        (dict(sliding_window=None), "sliding_window"),
    ],
)
def test_bad_attention_configs_are_refused(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dir(_config(tmp_path, **changes))


def test_tiny_gpt_oss_preset(tmp_path):
    """Reproducible, HF's config, sizes that split over TP 4, HF's greedy tokens past the window."""
    path = write_preset("tiny-gpt-oss", tmp_path / "a")
    again = write_preset("tiny-gpt-oss", tmp_path / "b")
    for f in ("config.json", "model.safetensors"):
        assert (path / f).read_bytes() == (again / f).read_bytes()
    cfg = ModelConfig.from_dir(path)
    assert (cfg.num_layers, cfg.sliding_layers, cfg.sliding_window, cfg.hidden_size) == (4, (0, 2), 32, 128)
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (8, 2)
    assert all(n % 4 == 0 for n in (cfg.num_heads, cfg.num_kv_heads, cfg.moe.expert_intermediate_size))
    model, tok = load_model(path), Tokenizer.from_dir(path)
    hf = transformers.GptOssForCausalLM.from_pretrained(path).eval()
    prompt = tok.encode("the cat and the dog " * 8)
    assert len(prompt) > 2 * cfg.sliding_window
    out = greedy_generate(model, prompt, 32, page_size=8)
    assert out == hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    assert len(set(out)) >= 4, out


def test_bf16_load_keeps_norms_fp32_and_tracks_fp32(case, tmp_path):
    """As HF keeps GPT-OSS's norms in fp32; bf16 logits stay near the fp32 ones at most positions
    (a few differ more where bf16 rounding flips an expert choice, in HF's bf16 model alike)."""
    hf, ours = case
    half = load_model(save(hf, tmp_path / "m"), dtype="bfloat16")
    assert half.norm.weight.dtype == torch.float32
    assert all(layer.input_layernorm.weight.dtype == torch.float32 for layer in half.layers)
    assert half.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = prompt_ids(30, seed=7)
    got = incremental_logits(half, ids, prompt_len=13, page_size=4, chunk=5)
    want = incremental_logits(ours, ids, prompt_len=13, page_size=4, chunk=5)
    assert got.dtype == torch.float32
    assert (got - want).abs().amax(dim=-1).median() < 0.05 * want.abs().max()
