"""A checkpoint's digest (model/checkpoint/identity.py) tells apart what would give different KV and nothing
else: another seed, one changed tensor, another config or tokenizer; not another directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from kvpipe.model.checkpoint.identity import HEAD_BYTES, checkpoint_digest
from kvpipe.model.presets.writer import write_preset


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preset("tiny", tmp_path_factory.mktemp("identity") / "tiny")


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_same_checkpoint_anywhere_same_digest(tiny: Path, tmp_path: Path):
    d = checkpoint_digest(tiny)
    assert len(d) == 64 and int(d, 16) >= 0
    assert checkpoint_digest(copy(tiny, tmp_path / "elsewhere")) == d
    assert checkpoint_digest(write_preset("tiny", tmp_path / "again")) == d  # written anew, same seed


def test_another_seed_differs(tiny: Path, tmp_path: Path):
    assert checkpoint_digest(write_preset("tiny", tmp_path / "tiny", seed=1)) != checkpoint_digest(tiny)


def test_one_changed_tensor_differs(tiny: Path, tmp_path: Path):
    """A change confined to one tensor (its middle element) is seen: every tensor is sampled."""
    other = copy(tiny, tmp_path / "tuned")
    tensors = load_file(str(other / "model.safetensors"))
    name = sorted(tensors)[len(tensors) // 2]
    flat = tensors[name].reshape(-1)
    flat[flat.size // 2] += 1.0
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert checkpoint_digest(other) != checkpoint_digest(tiny)


def test_config_and_tokenizer_count_but_not_their_formatting(tiny: Path, tmp_path: Path):
    d = checkpoint_digest(tiny)
    reformatted = copy(tiny, tmp_path / "reformatted")
    cfg = json.loads((tiny / "config.json").read_text())
    (reformatted / "config.json").write_text(json.dumps(dict(reversed(list(cfg.items())))))  # keys reordered
    assert checkpoint_digest(reformatted) == d
    theta = copy(tiny, tmp_path / "theta")
    (theta / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1234.0}))
    assert checkpoint_digest(theta) != d
    tok = copy(tiny, tmp_path / "tok")
    (tok / "tokenizer.json").write_text((tiny / "tokenizer.json").read_text().replace("<|eos|>", "<|end|>"))
    assert checkpoint_digest(tok) != d


def test_single_file_samples_its_body(tmp_path: Path):
    """A file without a tensor index (GGUF): its head and evenly spaced samples of the rest."""
    body = os.urandom(HEAD_BYTES + (1 << 20))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(body)
    b.write_bytes(body)
    assert checkpoint_digest(a) == checkpoint_digest(b)
    b.write_bytes(body[:HEAD_BYTES] + os.urandom(1 << 20))  # same metadata, other weights
    assert checkpoint_digest(a) != checkpoint_digest(b)
