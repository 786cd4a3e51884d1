"""Load an HF checkpoint directory (config.json + safetensors) into its family's model (registry.py).

Each TP rank reads only its slice of every sharded tensor (safe_open(...).get_slice), so a rank
never materialises the full q/k/v/o or MLP matrices.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.causal_lm import LMBase, check_parallel
from kvpipe.model.config import ModelConfig
from kvpipe.model.linear import Linear, Shard
from kvpipe.model.moe import check_routing
from kvpipe.model.packed_linear import packing_enabled
from kvpipe.model.registry import build_causal_lm, family

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: not a directory (expected a local HF checkpoint directory)")
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (expected a local HF checkpoint directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None


def check_supported(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """Reject config options the model code does not implement, rather than compute wrong logits."""
    fam = family(cfg.architecture)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not supported (only silu)")
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported by the Llama/Qwen model")
    if not fam.partial_rotary and float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    if raw.get("quantization_config"):  # e.g. DeepSeek-V3's fp8 blocks: their scales would be ignored
        method = (raw["quantization_config"] or {}).get("quant_method")
        raise ConfigError(f"quantized checkpoints are not supported (quant_method={method!r})")
    fam.check(raw, cfg)
    if cfg.moe is not None:
        check_routing(cfg.moe)


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
) -> LMBase:
    model_dir = Path(model_dir)
    raw = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf_dict(raw)
    check_supported(raw, cfg)
    files = weight_files(model_dir)
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
    missing = sorted(hf for hf, _ in plan.values() if hf not in files)
    if missing:
        raise ConfigError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    params = dict(model.named_parameters())
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}
        for name, (hf, shard) in plan.items():
            path = files[hf]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            t = read_shard(handles[path].get_slice(hf), shard)
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(
                    f"{model_dir}: tensor {hf} has shape {tuple(t.shape)}, "
                    f"expected {tuple(p.shape)} for this config and tp rank"
                )
            p.copy_(t)
    if packing_enabled():
        pack_linears(model)
    return model.eval()


def pack_linears(model: nn.Module) -> int:
    """Pack every Linear's weight for oneDNN where it can be (CPU fp32, packed_linear.py);
    returns how many were packed."""
    return sum(m.pack() for m in model.modules() if isinstance(m, Linear))


def load_generation_eos(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json first, then config.json's, without duplicates."""
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
