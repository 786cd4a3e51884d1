"""Flags of the KV tier on Mooncake Store (SGLang's names: --enable-hierarchical-cache,
--hicache-storage-backend mooncake; the store's settings default to SGLang's MOONCAKE_* variables)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping

from kvpipe.config import HICACHE_STORAGE_BACKENDS, ConfigError, HiCacheConfig

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """`268435456`, `256mb`, `4GB` -> bytes (SGLang's MOONCAKE_GLOBAL_SEGMENT_SIZE takes both)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?b?)\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes (e.g. 268435456 or 256mb): {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).rstrip("b")]


def _size_default(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if not value:
        return default
    try:
        return parse_bytes(value)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"${name}: {e}") from None


def add_hicache_args(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    d = HiCacheConfig()
    g = p.add_argument_group("KV tier on Mooncake Store (hierarchical cache)")
    g.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="share full prefix pages with every server of the model through a KV store "
        "(with --hicache-storage-backend)",
    )
    g.add_argument(
        "--hicache-storage-backend",
        choices=list(HICACHE_STORAGE_BACKENDS),
        default=None,
        help="the KV store behind --enable-hierarchical-cache (required with it; default: none)",
    )
    g.add_argument(
        "--hicache-mooncake-master",
        default=env.get("MOONCAKE_MASTER"),
        metavar="HOST:PORT",
        help="mooncake_master's RPC address (default: $MOONCAKE_MASTER)",
    )
    g.add_argument(
        "--hicache-mooncake-metadata-server",
        default=env.get("MOONCAKE_TE_META_DATA_SERVER", d.mooncake_metadata_server),
        help="P2PHANDSHAKE or the HTTP metadata server's URL, http://HOST:PORT/metadata "
        "(default: $MOONCAKE_TE_META_DATA_SERVER, else P2PHANDSHAKE)",
    )
    g.add_argument(
        "--hicache-mooncake-global-segment-size",
        type=parse_bytes,
        default=_size_default(env, "MOONCAKE_GLOBAL_SEGMENT_SIZE", d.mooncake_global_segment_bytes),
        help="memory this server lends the store, bytes or 256mb/4gb "
        "(default: $MOONCAKE_GLOBAL_SEGMENT_SIZE, else 256mb)",
    )
    g.add_argument(
        "--hicache-mooncake-local-buffer-size",
        type=parse_bytes,
        default=_size_default(env, "MOONCAKE_LOCAL_BUFFER_SIZE", d.mooncake_local_buffer_bytes),
        help="the client's transfer buffer (default: $MOONCAKE_LOCAL_BUFFER_SIZE, else 64mb)",
    )
    g.add_argument(
        "--hicache-mooncake-protocol",
        default=env.get("MOONCAKE_PROTOCOL", d.mooncake_protocol),
        help="tcp or rdma (default: $MOONCAKE_PROTOCOL, else tcp)",
    )
    g.add_argument(
        "--hicache-mooncake-device",
        default=env.get("MOONCAKE_DEVICE", d.mooncake_device),
        help="RDMA device (default: $MOONCAKE_DEVICE)",
    )
    g.add_argument(
        "--hicache-store-fetch-timeout",
        type=float,
        default=d.fetch_timeout_s,
        help="seconds a prompt waits for stored pages before computing them",
    )
    g.add_argument(
        "--hicache-store-retry-interval",
        type=float,
        default=d.retry_s,
        help="after a store failure, seconds of computing without it before trying it again",
    )


def hicache_config_from_args(args: argparse.Namespace) -> HiCacheConfig:
    if not hasattr(args, "enable_hierarchical_cache"):  # a command without these flags
        return HiCacheConfig()
    if args.enable_hierarchical_cache and getattr(args, "disable_radix_cache", False):
        raise ConfigError("--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)")
    return HiCacheConfig(
        enabled=args.enable_hierarchical_cache,
        storage_backend=args.hicache_storage_backend,
        mooncake_master=args.hicache_mooncake_master,
        mooncake_metadata_server=args.hicache_mooncake_metadata_server,
        mooncake_global_segment_bytes=args.hicache_mooncake_global_segment_size,
        mooncake_local_buffer_bytes=args.hicache_mooncake_local_buffer_size,
        mooncake_protocol=args.hicache_mooncake_protocol,
        mooncake_device=args.hicache_mooncake_device,
        fetch_timeout_s=args.hicache_store_fetch_timeout,
        retry_s=args.hicache_store_retry_interval,
    )
