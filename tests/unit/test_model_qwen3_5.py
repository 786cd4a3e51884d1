"""Qwen3.5 dense text model (gated delta-net + gated full attention) against HF transformers, fp32:
logits of whole prompts, chunked prefill (the recurrent state carried across chunks), paged
decode, packed batches, greedy generation, the TP config checks (TP itself:
tests/integration/test_model_qwen3_5_tp.py)."""

from __future__ import annotations

import pytest
import torch

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.checkpoint.schema import LayerType
from kvpipe.model.families.qwen3_5 import Qwen3_5CausalLM
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.presets import write_preset
from kvpipe.model.registry import model_config
from tests.helpers.paged_model import all_logits
from tests.helpers.preset_digests import digests
from tests.helpers.tolerance import assert_close_logits

# transformers (the `test` extra) with Qwen3.5: without them this module is skipped, not failed,
# so the helpers that build HF models are imported after the check
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

from tests.helpers.hf_models import VOCAB, hf_logits, prompt_ids, save  # noqa: E402
from tests.helpers.hybrid_model import F, L, greedy_generate, hf_qwen3_5, incremental_logits, pools  # noqa: E402

CASES = {
    # one full layer among three linear ones, untied, GQA everywhere
    "mixed": dict(),
    # linear first and last, two full layers, tied embeddings, grouped value heads x1, conv kernel 3,
    # MHA full attention with biases on q/k/v/o, full rotary
    "tied_bias_k3": dict(
        num_hidden_layers=5,
        layer_types=[L, F, L, F, L],
        tie_word_embeddings=True,
        linear_num_value_heads=2,
        linear_conv_kernel_dim=3,
        num_key_value_heads=4,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0},
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    hf = hf_qwen3_5(**CASES[request.param])
    return hf, load_model(save(hf, tmp_path_factory.mktemp(request.param)))


def test_config_parsed(case):
    hf, ours = case
    cfg = ours.cfg
    assert isinstance(ours, Qwen3_5CausalLM) and cfg.architecture == "qwen3_5" and cfg.hybrid is not None
    assert [t.value for t in cfg.hybrid.layer_types] == hf.config.layer_types
    assert cfg.kv_layers == tuple(i for i, t in enumerate(hf.config.layer_types) if t == F)
    assert cfg.rope_dim == int(cfg.head_dim * hf.config.rope_parameters.get("partial_rotary_factor", 1.0))
    assert cfg.hybrid.conv_dim == hf.model.layers[0].linear_attn.conv_dim


def test_default_layer_types_follow_hf():
    raw = hf_qwen3_5().config.to_dict()
    raw.pop("layer_types")
    raw.update(num_hidden_layers=8, full_attention_interval=4, architectures=["Qwen3_5ForCausalLM"])
    h = model_config(raw).hybrid
    assert h.full_layers == (3, 7) and h.layer_types[0] is LayerType.LINEAR_ATTENTION


def test_kv_pool_holds_full_attention_layers_only(case):
    _, ours = case
    kv, state = pools(ours, 4, 4, slots=3)
    assert kv.num_layers == len(ours.cfg.kv_layers)
    assert state.layers == ours.cfg.hybrid.linear_layers and state.num_slots == 3


def test_full_prompt_logits_match_hf(case):
    hf, ours = case
    ids = prompt_ids(77)  # more than one 64-token delta-rule chunk
    kv, state = pools(ours, 20, 4)
    got = ours(all_logits(ForwardBatch.build([ids], [0], [torch.arange(20)], 4, state_slots=[1])), kv, state)
    assert got.dtype == torch.float32 and got.shape == (77, VOCAB)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


@pytest.mark.parametrize("chunk", [None, 1, 3, 5, 70])
def test_chunked_prefill_and_paged_decode_match_hf(case, chunk):
    """Prompt of 75 tokens over pages of 4, in chunks that do not divide the page size (nor 64),
    then single-token decode steps: the conv and recurrent states cross every chunk boundary."""
    hf, ours = case
    ids = prompt_ids(90, seed=2)
    got = incremental_logits(ours, ids, prompt_len=75, page_size=4, chunk=chunk)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


def test_slot_is_reset_for_a_new_sequence(case):
    """A row with prefix_len 0 starts from zeros whatever its slot held before."""
    hf, ours = case
    kv, state = pools(ours, 10, 4)
    incremental_logits(
        ours, prompt_ids(20, seed=3), 15, 4, chunk=6, page_table=torch.arange(5), kv=kv, state=state, slot=1
    )
    ids = prompt_ids(19, seed=4)
    got = incremental_logits(ours, ids, 12, 4, chunk=5, page_table=torch.arange(5, 10), kv=kv, state=state, slot=1)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


def test_packed_batches_match_hf(case):
    """Packed prefill rows (a later chunk next to a fresh prompt), then batched one-token rows of
    three sequences in slots out of order, one of them a 1-token prompt: a fresh row makes that
    batch a prefill (it attends to its own new K/V), the next step is a decode."""
    hf, ours = case
    a, b, c = prompt_ids(14, seed=5), prompt_ids(9, seed=6), prompt_ids(4, seed=7)
    kv, state = pools(ours, 16, 3, slots=5)
    ta, tb, tc = torch.tensor([5, 2, 9, 0, 12]), torch.tensor([7, 1, 11, 13]), torch.tensor([3, 4])
    ours(ForwardBatch.build([a[:7]], [0], [ta], 3, state_slots=[4]), kv, state)
    got = ours(all_logits(ForwardBatch.build([a[7:12], b[:7]], [7, 0], [ta, tb], 3, state_slots=[4, 0])), kv, state)
    assert_close_logits(got[:5], hf_logits(hf, a[:12])[7:], ours.cfg, 12)
    assert_close_logits(got[5:], hf_logits(hf, b[:7]), ours.cfg, 7)
    for i in range(2):  # decode: a and b one token each, c's first token (a 1-token prompt) then its second
        batch = ForwardBatch.build(
            [[a[12 + i]], [b[7 + i]], [c[i]]], [12 + i, 7 + i, i], [ta, tb, tc], 3, state_slots=[4, 0, 2]
        )
        assert (batch.decode is None) == (i == 0)
        got = ours(batch, kv, state)
        assert_close_logits(got[0], hf_logits(hf, a[: 13 + i])[-1], ours.cfg, 13 + i)
        assert_close_logits(got[1], hf_logits(hf, b[: 8 + i])[-1], ours.cfg, 8 + i)
        assert_close_logits(got[2], hf_logits(hf, c[: 1 + i])[-1], ours.cfg, 1 + i)


def test_layer_groups_equal_full_forward(case):
    _, ours = case
    ids = prompt_ids(9, seed=8)
    batch = ForwardBatch.build([ids], [0], [torch.arange(3)], 4, state_slots=[0])
    (kv_a, st_a), (kv_b, st_b) = pools(ours, 3, 4), pools(ours, 3, 4)
    full = ours(batch, kv_a, st_a)
    h = ours.embed(batch)
    n = ours.num_layers
    for start, end in [(0, 1), (1, 1), (1, 3), (3, n)]:
        h = ours.forward_layers(h, batch, kv_b, start, end, st_b)
    assert torch.equal(ours.compute_logits(h, batch), full)
    for i in range(st_a.num_layers):
        assert torch.equal(st_a.recurrent[i], st_b.recurrent[i]) and torch.equal(st_a.conv[i], st_b.conv[i])
    with pytest.raises(ValueError, match="StatePool"):
        ours.forward_layers(h, batch, kv_b, 0, 1)


def test_state_snapshots_hold_the_state_of_their_prefix(case):
    """A prefill row of 150 tokens that snapshots its state after 8 and 100 of them (inside the
    first and the second 64-token block of the delta rule) and at its end (hybrid prefix cache):
    its logits are HF's and bitwise those of the row without snapshots, the row's slot and the end
    snapshot are the same state, and a forward that starts from either mid-row snapshot (its
    prefix's KV in the pool) gives HF's logits of the rest; a decode row snapshots the state after
    its token."""
    hf, ours = case
    n = 150
    ids, table = prompt_ids(n + 1, seed=9), torch.arange(38)
    kv, state = pools(ours, 38, 4, slots=5)
    snaps = [(0, 8, 2), (0, 100, 3), (0, n, 1)]  # (row, tokens, slot)
    batch = ForwardBatch.build([ids[:n]], [0], [table], 4, state_slots=[0], state_snapshots=snaps)
    want = hf_logits(hf, ids)
    got = ours(all_logits(batch), kv, state)
    assert_close_logits(got, want[:n], ours.cfg, n)
    kv2, state2 = pools(ours, 38, 4, slots=5)  # snapshots do not change the row's own arithmetic
    plain = ForwardBatch.build([ids[:n]], [0], [table], 4, state_slots=[0])
    assert torch.equal(ours(all_logits(plain), kv2, state2), got)
    for i in range(state.num_layers):
        assert torch.equal(state.recurrent[i][0], state2.recurrent[i][0])
        assert torch.equal(state.recurrent[i][1], state.recurrent[i][0]) and torch.equal(
            state.conv[i][1], state.conv[i][0]
        )
    for start, slot in ((8, 2), (100, 3)):
        state.copy_slots([slot], [4])  # the restore a cache hit does into the request's slot
        rest = ForwardBatch.build([ids[start:n]], [start], [table], 4, state_slots=[4])
        assert_close_logits(ours(all_logits(rest), kv, state), want[start:n], ours.cfg, n)
    step = ForwardBatch.build([[ids[n]]], [n], [table], 4, state_slots=[0], state_snapshots=[(0, 1, 2)])
    assert step.decode is not None
    assert_close_logits(ours(step, kv, state), want[n:], ours.cfg, n + 1)
    for i in range(state.num_layers):
        assert torch.equal(state.recurrent[i][2], state.recurrent[i][0]) and torch.equal(
            state.conv[i][2], state.conv[i][0]
        )


def test_greedy_generation_matches_hf_generate(case):
    hf, ours = case
    prompt = prompt_ids(10, seed=9)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    assert len(want) == 32
    assert greedy_generate(ours, prompt, 32, page_size=4) == want


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_qwen3_5(seed=1)
    path = save(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    ours = load_model(path)
    ids = prompt_ids(12, seed=10)
    assert_close_logits(incremental_logits(ours, ids, 12, 4), hf_logits(hf, ids), ours.cfg, len(ids))


def test_tp_rejects_indivisible_linear_heads(tmp_path):
    path = save(
        hf_qwen3_5(num_attention_heads=4, num_key_value_heads=4, linear_num_key_heads=1, linear_num_value_heads=2),
        tmp_path / "m",
    )
    with pytest.raises(ConfigError, match="linear-attention key heads"):
        Qwen3_5CausalLM(model_config_of(path), ParallelConfig(2, 0))


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory):
    return write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("tiny_qwen35"))


def test_tiny_qwen3_5_preset_matches_hf(preset_dir, tmp_path):
    assert digests(write_preset("tiny-qwen3.5", tmp_path / "again")) == digests(preset_dir)
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(preset_dir, dtype=torch.float32).eval()
    ours = load_model(preset_dir)
    assert ours.cfg.hybrid.full_layers == (3,) and ours.cfg.rope_dim == 8
    ids = [ours.cfg.bos_token_id, *prompt_ids(30, seed=11)]
    assert_close_logits(incremental_logits(ours, ids, 20, 8, chunk=7), hf_logits(hf, ids), ours.cfg, len(ids))
    out = greedy_generate(ours, ids[:12], 24, page_size=8)
    assert len(set(out)) >= 4, out  # not a degenerate model
