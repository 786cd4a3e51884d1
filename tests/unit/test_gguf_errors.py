"""GGUF files kvpipe refuses, each with one ConfigError that names the reason: another family,
an unsupported or unknown tensor type, a truncated or corrupt file, tensors the family lacks,
no file or several; and the metadata variants it maps (rope scaling, end-of-turn ids)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.checkpoint import GGUFCheckpoint
from kvpipe.model.checkpoint.gguf.reader import find_gguf
from tests.helpers.gguf_files import Q, patch_tensor_type, write_gguf


def refused(path, *words: str) -> str:
    with pytest.raises(ConfigError) as e:
        GGUFCheckpoint.open(path)
    msg = str(e.value)
    assert all(w in msg for w in words), msg
    return msg


def test_unsupported_architecture_is_named(tmp_path):
    w = write_gguf(tmp_path / "m.gguf", "llama", arch="gemma2")
    refused(w.path, "'gemma2'", "not supported", "llama")


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    w = write_gguf(tmp_path / "m.gguf", "llama", Q.TQ1_0)
    refused(w.path, "token_embd.weight (TQ1_0)", "unsupported tensor types", "Q4_K")


def test_unknown_tensor_type_id_names_tensor(tmp_path):
    w = write_gguf(tmp_path / "m.gguf", "llama", Q.Q8_0)
    patch_tensor_type(w.path, "blk.1.attn_v.weight", 99)
    refused(w.path, "blk.1.attn_v.weight", "unknown GGML type id 99")


@pytest.mark.parametrize("keep", [0, 3, 24, 200, 3000, 0.5, -1])
def test_truncated_file(tmp_path, keep):
    """Cut in the magic, the header, the metadata, the tensor table, the data, and one byte short."""
    w = write_gguf(tmp_path / "m.gguf", "llama", Q.Q4_0)
    blob = w.path.read_bytes()
    n = int(len(blob) * keep) if isinstance(keep, float) else (len(blob) + keep if keep < 0 else keep)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(blob[:n])
    refused(cut, str(cut), "not a readable GGUF file", "truncated or corrupt")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    refused(p, "not a readable GGUF file", "magic")


def test_tensor_the_family_lacks(tmp_path):
    w = write_gguf(tmp_path / "m.gguf", "llama", extra_tensors={"blk.0.ffn_up.bias": np.zeros(256, np.float32)})
    refused(w.path, "blk.0.ffn_up.bias", "llama model does not have")
    w = write_gguf(tmp_path / "q.gguf", "llama", extra_tensors={"blk.0.attn_q_norm.weight": np.zeros(64, np.float32)})
    refused(w.path, "blk.0.attn_q_norm.weight")  # a qwen3 tensor in a llama file


def test_rope_freqs_refused_with_reason(tmp_path):
    w = write_gguf(tmp_path / "m.gguf", "llama", extra_tensors={"rope_freqs.weight": np.ones(32, np.float32)})
    refused(w.path, "rope_freqs.weight", "Llama 3.1")


def test_partial_rotary_refused(tmp_path):
    w = write_gguf(tmp_path / "m.gguf", "llama", meta={"llama.rope.dimension_count": 32})
    refused(w.path, "rope.dimension_count 32", "partial rotary")


def test_split_file_refused(tmp_path):
    w = write_gguf(tmp_path / "m.gguf", "llama", meta={"split.count": 3})
    refused(w.path, "3-way split")


def test_paths(tmp_path):
    refused(tmp_path / "none.gguf", "not a .gguf file")
    assert find_gguf(tmp_path) is None  # an empty directory
    w = write_gguf(tmp_path / "a.gguf", "llama")
    assert find_gguf(tmp_path) == w.path and find_gguf(w.path) == w.path
    assert GGUFCheckpoint.open(tmp_path).path == w.path
    write_gguf(tmp_path / "b.gguf", "llama")
    refused(tmp_path, "holds 2 GGUF files", "a.gguf, b.gguf")
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path) is None  # a directory with config.json is an HF checkpoint


@pytest.mark.parametrize(
    "meta, want",
    [
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
            {"rope_type": "linear", "factor": 4.0},
        ),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.original_context_length": 32768,
            },
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        ),
        ({"llama.rope.scaling.type": "none"}, None),
    ],
)
def test_rope_scaling(tmp_path, meta, want):
    ck = GGUFCheckpoint.open(write_gguf(tmp_path / "m.gguf", "llama", meta=meta).path)
    assert ck.config.get("rope_scaling") == want


def test_rope_scaling_type_refused(tmp_path):
    meta = {"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}
    refused(write_gguf(tmp_path / "m.gguf", "llama", meta=meta).path, "'longrope'")


def test_end_of_turn_token_joins_eos(tmp_path):
    ck = GGUFCheckpoint.open(write_gguf(tmp_path / "m.gguf", "llama", meta={"tokenizer.ggml.eot_token_id": 3}).path)
    assert ck.config["eos_token_id"] == [2, 3]
    assert ck.tokenizer().eos_token_ids == (2, 3)


def test_missing_metadata_named(tmp_path):
    refused(write_gguf(tmp_path / "m.gguf", "llama", meta={"llama.block_count": None}).path, "'llama.block_count'")
