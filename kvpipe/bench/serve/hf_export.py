"""A GGUF file as a plain HF checkpoint directory (config.json, model.safetensors, tokenizer files):
what another serving engine (vLLM) loads, so that both servers of `bench serve --compare-vllm` read
the same weights, dequantized once, in the same dtype.

HF transformers dequantizes the GGUF (`from_pretrained(..., gguf_file=...)`, needs `gguf`); its
`save_pretrained` refuses a GGUF-loaded model, so the state dict is written with safetensors and
the config without its `quantization_config` (docs/architecture.md, DESIGN §9). The directory is
made once per (GGUF bytes, dtype): `export_dir` names it by the file's identity, and a finished
export is marked by a file written last, so a cut export is redone, never served half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kvpipe.model.checkpoint.identity import checkpoint_digest

DONE_MARK = "kvpipe-export.json"  # written last: the directory is complete
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def export_dir(gguf: str | Path, dtype: str, root: str | Path | None = None) -> Path:
    """Where `gguf` exported in `dtype` lives: under `root` (default: the user's cache), named by the
    file's stem, the dtype and a digest of its bytes (a changed file gets a new directory)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose from {', '.join(EXPORT_DTYPES)}")
    base = Path(root) if root is not None else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    ident = checkpoint_digest(gguf)[:12]
    return base / "kvpipe" / "hf-export" / f"{Path(gguf).stem}-{dtype}-{ident}"


def gguf_to_hf_dir(gguf: str | Path, dtype: str = "float32", root: str | Path | None = None) -> Path:
    """The HF directory of `gguf` in `dtype` (made now unless a finished one exists); returns it."""
    out = export_dir(gguf, dtype, root)
    if (out / DONE_MARK).is_file():
        return out
    import torch  # heavy: only when an export is really made
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700: a server run as another user reads it too
    try:
        # tied embeddings: lm_head is embed_tokens, which HF checkpoints store once, under the
        # embedding's name (safetensors' save_model may keep the other name, which loaders ignore)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = config.get("architectures") or [type(model).__name__]  # a GGUF load leaves none
        config["torch_dtype"] = config["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / DONE_MARK).write_text(json.dumps({"gguf": str(src.resolve()), "dtype": dtype}) + "\n")
        shutil.rmtree(out, ignore_errors=True)  # a cut export of the same name
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
