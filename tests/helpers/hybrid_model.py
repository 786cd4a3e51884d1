"""The Qwen3.5 (hybrid) model tests' random tiny HF checkpoints, and a driver that runs a hybrid
model through the paged KV pool and a StatePool like the engine does."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import torch
import transformers

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool
from kvpipe.engine.model_runner import make_kv_pool, make_state_pool
from kvpipe.model.forward_batch import ForwardBatch
from tests.helpers.hf_models import VOCAB
from tests.helpers.paged_model import all_logits

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

L, F = "linear_attention", "full_attention"


class HybridKwargs(TypedDict, total=False):
    """The keyword arguments of Qwen3.5's text configs (dense and MoE) the tiny checkpoints set
    (typed, so mypy checks them against the configs' fields)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: list[str]
    max_position_embeddings: int
    initializer_range: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope_parameters: dict[str, object]
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


class Qwen3_5Kwargs(HybridKwargs, total=False):
    """Qwen3_5TextConfig's: a dense MLP."""

    intermediate_size: int


class Qwen3_5MoeKwargs(HybridKwargs, total=False):
    """Qwen3_5MoeTextConfig's: the sparse MLP and its shared expert."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int


def hf_qwen3_5(seed: int = 0, **overrides: Unpack[Qwen3_5Kwargs]) -> transformers.Qwen3_5ForCausalLM:
    """A random tiny Qwen3.5 text model: GQA in both attention kinds (2 value heads per key head in
    the delta-net), partial RoPE, random norm weights and dt_bias (HF inits them to constants,
    which would hide a wrong (1 + w) or a missing bias)."""
    kw = Qwen3_5Kwargs(**_TINY, intermediate_size=96)
    kw.update(overrides)
    torch.manual_seed(seed)
    return _randomize(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw)).eval())


def hf_qwen3_5_moe(seed: int = 0, **overrides: Unpack[Qwen3_5MoeKwargs]) -> transformers.Qwen3_5MoeForCausalLM:
    """hf_qwen3_5's model with Qwen3.5-MoE's MLP in every layer: 8 experts of 24, top 3, and a
    shared expert of 40 behind its sigmoid gate."""
    kw = Qwen3_5MoeKwargs(
        **_TINY, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kw)).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # a decisive router (HF inits it to zeros: all ties)
            layer.mlp.gate.weight.normal_(0, 0.3)
    return _randomize(model)


_TINY = HybridKwargs(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    layer_types=[L, F, L, L],
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
    return model


def pools(model, num_pages: int, page_size: int, slots: int = 4) -> tuple[KVPool, StatePool]:
    state = make_state_pool(model, slots)
    assert state is not None
    return make_kv_pool(model, num_pages, page_size), state


@torch.no_grad()
def incremental_logits(
    model,
    ids: list[int],
    prompt_len: int,
    page_size: int,
    chunk: int | None = None,
    page_table: torch.Tensor | None = None,
    kv: KVPool | None = None,
    state: StatePool | None = None,
    slot: int = 2,
) -> torch.Tensor:
    """Logits of every position of `ids`: the prompt in chunks of `chunk` tokens (whole when
    None), then one decode step per remaining token, the recurrent state in StatePool slot `slot`."""
    n_pages = -(-len(ids) // page_size)
    if page_table is None:  # scattered, non-contiguous pages
        page_table = torch.randperm(n_pages + 3, generator=torch.Generator().manual_seed(1))[:n_pages]
    if kv is None or state is None:
        kv, state = pools(model, int(page_table.max()) + 1, page_size)
    out, pos = [], 0
    step = chunk or prompt_len
    while pos < len(ids):
        n = min(step, prompt_len - pos) if pos < prompt_len else 1
        batch = ForwardBatch.build([ids[pos : pos + n]], [pos], [page_table], page_size, state_slots=[slot])
        out.append(model(all_logits(batch), kv, state))
        pos += n
    return torch.cat(out)


@torch.no_grad()
def greedy_generate(model, prompt: list[int], n: int, page_size: int, slot: int = 0) -> list[int]:
    n_pages = -(-(len(prompt) + n) // page_size)
    table = torch.arange(n_pages)
    kv, state = pools(model, n_pages, page_size)
    tok = int(model(ForwardBatch.build([prompt], [0], [table], page_size, state_slots=[slot]), kv, state)[0].argmax())
    out = [tok]
    for i in range(n - 1):
        batch = ForwardBatch.build([[tok]], [len(prompt) + i], [table], page_size, state_slots=[slot])
        tok = int(model(batch, kv, state)[0].argmax())
        out.append(tok)
    return out
