"""--dtype and --kv-cache-dtype (SGLang's names) -> ServerConfig.dtype and
CacheConfig.kv_cache_dtype; refusals; the pool dtype each name resolves to."""

from __future__ import annotations

import pytest
import torch

from kvpipe.cache.kv_dtype import kv_storage_dtype
from kvpipe.cli import build_parser
from kvpipe.commands.flags import server_config_from_args
from kvpipe.config import KV_CACHE_DTYPES, MODEL_DTYPES, CacheConfig, ConfigError, ServerConfig


def parse(*flags: str) -> ServerConfig:
    argv = ["serve", "--model-path", "m", *flags]
    parser, _ = build_parser(argv)
    return server_config_from_args(parser.parse_args(argv))


def test_defaults_are_auto() -> None:
    cfg = parse()
    assert (cfg.dtype, cfg.cache.kv_cache_dtype) == ("auto", "auto")


@pytest.mark.parametrize("kv", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_every_name_maps_onto_the_configs(dtype: str, kv: str) -> None:
    cfg = parse("--dtype", dtype, "--kv-cache-dtype", kv)
    assert (cfg.dtype, cfg.cache.kv_cache_dtype) == (dtype, kv)


def test_unknown_names_are_refused() -> None:
    for flag, bad in (("--dtype", "int8"), ("--kv-cache-dtype", "fp8"), ("--kv-cache-dtype", "float32")):
        with pytest.raises(SystemExit):
            parse(flag, bad)
    with pytest.raises(ConfigError, match="KV cache dtype"):
        CacheConfig(kv_cache_dtype="fp4_e2m1")
    with pytest.raises(ConfigError, match="dtype must be one of"):
        ServerConfig(model_path="m", dtype="float64")


def test_pool_dtypes() -> None:
    assert kv_storage_dtype("auto", torch.float32) == torch.float32
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_storage_dtype("float16", torch.float32) == torch.float16
    assert kv_storage_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError):
        kv_storage_dtype("fp8", torch.float32)
