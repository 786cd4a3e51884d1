"""kvpipe's model of a sliding-window family (GPT-OSS, Gemma 3) against the HF model of the same
random checkpoint, fp32, on the three attention paths: the whole prompt, chunks behind a cached
prefix then decode steps past the window, and one batched paged decode over rows shorter than,
as long as and longer than the window; greedy generation against HF's `generate`; and the
family's tiny preset (reproducible, HF's greedy tokens)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.presets import write_preset
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.hf_models import hf_logits, prompt_ids
from tests.helpers.paged_model import all_logits, greedy_generate, incremental_logits, make_pool
from tests.helpers.tolerance import assert_close_logits


def full_prompt_matches_hf(hf, ours: CausalLM) -> None:
    ids = prompt_ids(37)  # several windows long
    batch = all_logits(ForwardBatch.build([ids], [0], [torch.arange(10)], 4))
    assert_close_logits(ours(batch, make_pool(ours, 10, 4)), hf_logits(hf, ids), ours.cfg, len(ids))


def chunks_and_decode_past_window_match_hf(hf, ours: CausalLM, chunk: int | None) -> None:
    """A 13-token prompt over pages of 4 in chunks that do not divide the page, then 27 decode
    steps: the sliding layers' windows move past the first pages."""
    ids = prompt_ids(40, seed=2)
    got = incremental_logits(ours, ids, prompt_len=13, page_size=4, chunk=chunk)
    assert_close_logits(got, hf_logits(hf, ids), ours.cfg, len(ids))


def batched_decode_rows_match_hf(hf, ours: CausalLM) -> None:
    """One decode forward over three rows: shorter than, equal to and longer than the window."""
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
        assert_close_logits(row, hf_logits(hf, s)[-1], ours.cfg, len(s))


def greedy_matches_hf_generate(hf, ours: CausalLM) -> None:
    prompt = prompt_ids(10, seed=6)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    assert len(want) == 32
    assert greedy_generate(ours, prompt, 32, page_size=4) == want


def preset_is_reproducible_and_matches_hf(name: str, tmp_path: Path, hf_class) -> ModelConfig:
    """Preset `name` written twice gives the same bytes; loaded by kvpipe and by `hf_class`
    (transformers), its greedy tokens past two windows are equal and varied. Returns its config."""
    path = write_preset(name, tmp_path / "a")
    again = write_preset(name, tmp_path / "b")
    for f in ("config.json", "model.safetensors"):
        assert (path / f).read_bytes() == (again / f).read_bytes()
    model, tok = load_model(path), Tokenizer.from_dir(path)
    assert isinstance(model, CausalLM)
    cfg = model.cfg
    assert cfg.sliding_window is not None
    hf = hf_class.from_pretrained(path).eval()
    prompt = tok.encode("the cat and the dog " * 8)
    assert len(prompt) > 2 * cfg.sliding_window
    out = greedy_generate(model, prompt, 32, page_size=8)
    # EOS ignored on both sides: greedy_generate does not stop at it
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out == want[0, len(prompt) :].tolist()
    assert len(set(out)) >= 4, out
    return cfg
