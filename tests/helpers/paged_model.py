"""Drive a CausalLM through the paged KV pool like the engine does: every position's logits of a
prompt prefilled in chunks and then decoded token by token, and greedy generation."""

from __future__ import annotations

import dataclasses

import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.engine.model_runner import make_kv_pool
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.forward_batch import ForwardBatch


def make_pool(model: CausalLM, num_pages: int, page_size: int) -> KVPool:
    """One page table for every layer (sliding ones too): the tests index pages by hand."""
    return make_kv_pool(model, num_pages, page_size, window_tables=False)


def all_logits(batch: ForwardBatch) -> ForwardBatch:
    """The same batch, asking for the logits of every packed token."""
    return dataclasses.replace(batch, logit_indices=torch.arange(batch.num_tokens))


@torch.no_grad()
def incremental_logits(
    model: CausalLM,
    ids: list[int],
    prompt_len: int,
    page_size: int,
    chunk: int | None = None,
    page_table: torch.Tensor | None = None,
    pool: KVPool | None = None,
) -> torch.Tensor:
    """Logits of every position of `ids` [len(ids), vocab]: the prompt prefilled in chunks of
    `chunk` tokens (all at once when None), then one decode step per remaining token."""
    n_pages = -(-len(ids) // page_size)
    if page_table is None:  # scattered, non-contiguous pages
        page_table = torch.randperm(n_pages + 3, generator=torch.Generator().manual_seed(1))[:n_pages]
    pool = pool or make_pool(model, int(page_table.max()) + 1, page_size)
    out, pos = [], 0
    step = chunk or prompt_len
    while pos < len(ids):
        n = min(step, prompt_len - pos) if pos < prompt_len else 1
        batch = all_logits(ForwardBatch.build([ids[pos : pos + n]], [pos], [page_table], page_size))
        out.append(model(batch, pool))
        pos += n
    return torch.cat(out)


@torch.no_grad()
def greedy_generate(model: CausalLM, prompt: list[int], n: int, page_size: int) -> list[int]:
    n_pages = -(-(len(prompt) + n) // page_size)
    table = torch.arange(n_pages)
    pool = make_pool(model, n_pages, page_size)
    tok = int(model(ForwardBatch.build([prompt], [0], [table], page_size), pool)[0].argmax())
    out = [tok]
    for i in range(n - 1):
        batch = ForwardBatch.build([[tok]], [len(prompt) + i], [table], page_size)
        tok = int(model(batch, pool)[0].argmax())
        out.append(tok)
    return out
