"""Load a checkpoint into its family's model (registry.py): an HF directory (config.json +
safetensors) or a GGUF file (gguf/: config from its metadata, tensors dequantized on the way).

Each TP rank reads only its slice of every sharded tensor (safe_open(...).get_slice, or a GGUF
tensor's row range), so a rank never materialises the full q/k/v/o or MLP matrices; a GGUF
tensor is dequantized once, in float32, and cast into the engine's dtype by the copy.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.gguf.checkpoint import GGUFCheckpoint, gguf_checkpoint
from kvpipe.model.checkpoint.gguf.tensors import progress_bar
from kvpipe.model.checkpoint.schema import ModelConfig, partial_rotary_dim
from kvpipe.model.cpu.fused_decode import build_fused_decode
from kvpipe.model.cpu.fused_projections import fuse_projections, fusing_enabled
from kvpipe.model.cpu.huge_pages import place_weights
from kvpipe.model.cpu.packed_linear import packing_enabled
from kvpipe.model.families.causal_lm import LMBase, check_parallel
from kvpipe.model.layers.linear import Linear, Shard
from kvpipe.model.layers.moe import check_routing
from kvpipe.model.quant.kv_scales import KVScales, read_kv_scales
from kvpipe.model.quant.quantize import check_quantization, quantize_model
from kvpipe.model.registry import build_causal_lm, family, model_config
from kvpipe.model.text.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

logger = logging.getLogger(__name__)

# HF tensor name -> an object sliced like safetensors' get_slice (sl[:], sl[a:b], sl[:, a:b])
SliceSource = Callable[[str], Any]


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as `from_pretrained` takes it


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of an HF directory, or the equivalent dict a GGUF file's metadata gives."""
    ckpt = gguf_checkpoint(model_dir)
    if ckpt is not None:
        return ckpt.config
    path = Path(model_dir) / "config.json"
    expected = "expected a local HF checkpoint directory, a .gguf file, or a directory holding one"
    if not Path(model_dir).is_dir():
        what = "no such file or directory" if not Path(model_dir).exists() else "not a directory or a .gguf file"
        if not Path(model_dir).exists() and _HUB_ID.fullmatch(str(model_dir)):
            expected = (
                "a Hugging Face hub id? kvpipe reads local files only: `kvpipe models fetch NAME` fetches the "
                f"models of `kvpipe models list`, `huggingface-cli download {model_dir} --local-dir DIR` others"
            )
        raise ConfigError(f"{model_dir}: {what} ({expected})")
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json and no .gguf file ({expected})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None


def check_supported(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """Reject config options the model code does not implement, rather than compute wrong logits."""
    fam = family(cfg.architecture)
    if cfg.hidden_act not in fam.activations:
        only = ", ".join(fam.activations)
        raise ConfigError(f"hidden_act={cfg.hidden_act!r} is not supported for {cfg.architecture} (only {only})")
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported by the Llama/Qwen model")
    # read as a partial-rotary family would (top level or rope_parameters, or rotary_dim), so no
    # key turns part of each head into the whole silently
    if not fam.partial_rotary and partial_rotary_dim(raw, cfg.head_dim) is not None:
        raise ConfigError(f"partial_rotary_factor != 1 is not supported for {cfg.architecture}")
    if raw.get("quantization_config"):  # e.g. DeepSeek-V3's fp8 blocks: their scales would be ignored
        method = (raw["quantization_config"] or {}).get("quant_method")
        raise ConfigError(f"quantized checkpoints are not supported (quant_method={method!r})")
    fam.check(raw, cfg)
    if cfg.moe is not None:
        check_routing(cfg.moe)


def check_checkpoint(
    model_path: str | Path, tokenizer_path: str | Path | None = None, quantization: str | None = None
) -> ModelConfig:
    """Everything about a checkpoint that can be refused before a model is built: its config
    (for a GGUF file also its header, family and tensor types, and truncation), the options the
    model code lacks (--quantization included), and its tokenizer. Commands call it first, so a
    bad checkpoint ends them with one ConfigError line rather than a traceback from the engine
    thread. A GGUF file is opened once per process (gguf_checkpoint), so the engine's load reuses
    this work."""
    raw = read_hf_config(model_path)
    cfg = model_config(raw)
    check_supported(raw, cfg)
    check_quantization(quantization, cfg)
    Tokenizer.from_dir(tokenizer_path or model_path)
    return cfg


def check_group(parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
    """TP > 1 needs an initialised process group of exactly tp_size ranks (else all_reduce hangs)."""
    if parallel.tp_size == 1:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"tp_size={parallel.tp_size} needs torch.distributed initialised on every rank")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != parallel.tp_size or rank != parallel.tp_rank:
        raise ConfigError(
            f"process group has rank {rank} of {size}, but ParallelConfig says "
            f"rank {parallel.tp_rank} of {parallel.tp_size}"
        )


def resolve_dtype(dtype: torch.dtype | str | None, cfg: ModelConfig, device: str | torch.device) -> torch.dtype:
    """None: fp32 on CPU (half-precision matmuls are slow there), the checkpoint's dtype elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return torch.float32
    return _DTYPES.get(cfg.dtype, torch.float32)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: model_dir / f for name, f in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise ConfigError(f"{model_dir}: shard files listed in the index are missing: {missing}")
        return files
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ConfigError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def hf_name(name: str, renames: tuple[tuple[str, str], ...] = ()) -> str:
    """Our parameter name -> the checkpoint's: the module tree mirrors HF's under `model.`, with
    the family's checkpoint renames (registry.Family.checkpoint_renames) on top."""
    if name == "embed_tokens":
        return "model.embed_tokens.weight"
    hf = name if name.startswith("lm_head.") else "model." + name
    for pattern, repl in renames:
        hf = re.sub(pattern, repl, hf)
    return hf


def shard_plan(model: LMBase) -> dict[str, tuple[str, Shard | None]]:
    """our param name -> (HF name, this rank's Shard of it or None for the whole tensor).

    Linears carry their Shard; any other module may declare `param_shards` ({param: Shard}).
    """
    shards: dict[str, Shard] = {}
    for mod_name, mod in model.named_modules():
        shard = getattr(mod, "shard", None)  # sharded Linears, and norms over a sharded projection
        if shard is not None:
            shards[f"{mod_name}.weight"] = shard
            if getattr(mod, "bias", None) is not None and shard.dim == 0:  # a row-parallel bias is added once, whole
                shards[f"{mod_name}.bias"] = shard
        for pname, s in getattr(mod, "param_shards", {}).items():
            shards[f"{mod_name}.{pname}"] = s
    renames = family(model.cfg.architecture).checkpoint_renames
    return {name: (hf_name(name, renames), shards.get(name)) for name, _ in model.named_parameters()}


def read_shard(sl: Any, shard: Shard | None) -> torch.Tensor:
    """This rank's part of a safetensors slice: whole, or its ranges along shard.dim, concatenated."""
    if shard is None:
        return sl[:]
    lead = (slice(None),) * shard.dim  # GPT-OSS's fused experts [E, hidden, 2 I] split along dim 2
    parts = [sl[lead + (slice(a, a + n),)] for a, n in shard.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)


def keep_fp32(model: nn.Module) -> None:
    """Parameters a module lists in `keep_fp32` (e.g. a router's correction bias) go back to fp32
    after the model was cast to a half dtype, as HF keeps them."""
    for mod in model.modules():
        for pname in getattr(mod, "keep_fp32", ()):
            p = getattr(mod, pname, None)
            if p is not None and p.dtype != torch.float32:
                setattr(mod, pname, nn.Parameter(p.detach().float(), requires_grad=False))


def load_model(
    model_dir: str | Path,
    parallel: ParallelConfig = ParallelConfig(),
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    group: dist.ProcessGroup | None = None,
    quantization: str | None = None,
    decode_fused_layer: str = "auto",
) -> LMBase:
    """`model_dir`: an HF checkpoint directory, a .gguf file, or a directory holding one;
    `quantization`: --quantization's weight-only int8/int4 linears (quantization.py);
    `decode_fused_layer`: --decode-fused-layer, a decode step's layers as one C++ call each
    (fused_decode.py)."""
    model_dir = Path(model_dir)
    ckpt = gguf_checkpoint(model_dir)
    raw = ckpt.config if ckpt is not None else read_hf_config(model_dir)
    cfg = model_config(raw)
    check_supported(raw, cfg)
    check_quantization(quantization, cfg, device)
    names: set[str] = set(ckpt.tensors) if ckpt is not None else set(weight_files(model_dir))
    check_parallel(cfg, parallel)
    check_group(parallel, group)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    # Build on the meta device (no allocation, no random init), then allocate uninitialised.
    with torch.device("meta"):
        model = build_causal_lm(cfg, parallel, group)
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    keep_fp32(model)
    model.init_rope(device)  # inv_freq was computed on meta above; compute it for real, in fp32
    plan = shard_plan(model)
    missing = sorted(hf for hf, _ in plan.values() if hf not in names)
    if missing:
        raise ConfigError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    params = dict(model.named_parameters())
    what = f"{ckpt.path} ({_gguf_summary(ckpt)})" if ckpt is not None else str(model_dir)
    rank = f" (tp rank {parallel.tp_rank} of {parallel.tp_size})" if parallel.tp_size > 1 else ""
    logger.info("loading %s%s into %s on %s", what, rank, str(torch_dtype).removeprefix("torch."), device)
    start = time.monotonic()
    desc = "dequantizing GGUF" if ckpt is not None else "loading safetensors"
    # one bar (rank 0's, on a terminal only); the log lines above and below are every rank's
    bar = progress_bar(len(plan), None if parallel.tp_rank == 0 else False, desc)
    with _slices(model_dir, ckpt) as get_slice, torch.no_grad(), bar:
        for name, (hf, shard) in plan.items():
            _copy_checked(params[name], read_shard(get_slice(hf), shard), hf, model_dir)
            bar.update()
        # the dense weights live on in the model only: fusing, packing and quantizing below replace
        # them, and this dict held a second copy of every one to the end (2.2 GB more at the peak
        # for Qwen2.5-Coder-0.5B, 8.4 GB, where three PD servers loading at once met the OOM killer)
        del params
        model.kv_scales = _kv_scales(model, names, get_slice)
        if quantization is not None:
            whole = None if parallel.tp_size == 1 else lambda hf: get_slice(hf)[:]
            tensors = ckpt.tensors if ckpt is not None else None
            counts = quantize_model(model, quantization, plan, tensors, whole)
            made = ", ".join(f"{k} x {n}" for k, n in counts.items())
            logger.info("--quantization %s%s: %s", quantization, rank, made)
    logger.info("loaded %d tensors%s in %.1f s", len(plan), rank, time.monotonic() - start)
    if model.kv_scales.found:
        logger.info(
            "fp8 KV scales for %d of %d KV layers from the checkpoint", model.kv_scales.found, len(cfg.kv_layers)
        )
    if fusing_enabled() and torch.device(device).type == "cpu":
        fuse_projections(model)
    if packing_enabled():
        pack_linears(model)
        model.pack_head()
    if torch.device(device).type == "cpu":  # after fusing and packing: the final weights
        place_weights(model)
        model.fused_decode = build_fused_decode(model, decode_fused_layer)
    return model.eval()


def _copy_checked(p: torch.Tensor, t: torch.Tensor, hf: str, model_dir: Path) -> None:
    if tuple(t.shape) != tuple(p.shape):
        raise ConfigError(
            f"{model_dir}: tensor {hf} has shape {tuple(t.shape)}, "
            f"expected {tuple(p.shape)} for this config and tp rank"
        )
    p.copy_(t)


def _kv_scales(model: LMBase, names: set[str], get_slice: SliceSource) -> KVScales:
    """The checkpoint's per-layer K/V scales of an fp8 KV cache (kv_scales.py), 1.0 where absent."""
    renames = family(model.cfg.architecture).checkpoint_renames
    attn = [hf_name(f"layers.{i}.self_attn.x", renames).removesuffix(".x") for i in model.cfg.kv_layers]
    return read_kv_scales(attn, names, lambda n: get_slice(n)[...])  # [...]: 0-d tensors too


@contextmanager
def _slices(model_dir: Path, ckpt: GGUFCheckpoint | None) -> Iterator[SliceSource]:
    """Where each HF tensor is read from: the GGUF's lazily dequantized tensors (a row range
    dequantizes only those rows), or the safetensors files, each opened once."""
    if ckpt is not None:
        yield ckpt.tensors.__getitem__
        return
    files = weight_files(model_dir)
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def get_slice(hf: str) -> Any:
            path = files[hf]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            return handles[path].get_slice(hf)

        yield get_slice


def _gguf_summary(ckpt: GGUFCheckpoint) -> str:
    """e.g. 'llama, 272 tensors: Q4_1 x 180, Q8_0 x 31, F32 x 61'."""
    counts: dict[str, int] = {}
    for t in ckpt.tensors.values():
        counts[t.ggml_type] = counts.get(t.ggml_type, 0) + 1
    kinds = ", ".join(f"{k} x {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"GGUF {ckpt.family}, {len(ckpt.tensors)} tensors: {kinds}"


def pack_linears(model: nn.Module) -> int:
    """Pack every Linear's weight where it can be (CPU fp32: column panels, panel_weight.py, or
    oneDNN's form, packed_linear.py); returns how many were packed."""
    return sum(m.pack() for m in model.modules() if isinstance(m, Linear))


def load_generation_eos(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json first, then config.json's, without duplicates. A GGUF
    file has neither: its EOS (and end-of-turn) ids are in its config (ModelConfig.eos_token_ids)
    and its tokenizer."""
    if gguf_checkpoint(model_dir) is not None:
        return ()
    ids: list[int] = []
    for fname in ("generation_config.json", "config.json"):
        path = Path(model_dir) / fname
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        for i in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)
