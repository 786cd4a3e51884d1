"""What every rank of a PD server sets up: a transfer backend with the rank's KV shard
registered once, the rank's KV layout (its head range), and the data-plane host.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool
from kvpipe.config import ConfigError, ParallelConfig, ServerConfig
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.transfer.backends.base import BackendOptions, TransferBackend
from kvpipe.transfer.backends.registry import backend_spec, open_backend
from kvpipe.transfer.control.auth import TOKEN_ENV
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.recurrent.layout import StateLayout

logger = logging.getLogger(__name__)

# How long the engine loop sleeps when its only work is waiting for transfers: long enough not
# to spin a core (a busy-polling loop halves throughput on 2 cores, docs/architecture.md), short
# enough to add at most this much to a request's TTFT.
TRANSFER_POLL_S = 0.002
# The decode's engine loop, waiting only for KV to land, sleeps until its receiver calls it
# (every room it can report wakes it: KVReceiver's on_news); this is a backstop. Polling at
# TRANSFER_POLL_S cost the decode ~0.4 CPU-s of Python per 2,048-token request on a 110 Mbit/s
# link (0.63-0.72 CPU-s against 0.25 now), taken from the cores the prefill computes on when
# both share a machine (issue 34: the layer-pipelined prefill's forward ran slower).
DECODE_TRANSFER_BACKSTOP_S = 0.1

_WILDCARDS = ("0.0.0.0", "::", "")


def data_host(cfg: ServerConfig) -> str:
    """The address peers reach this server's transfer engine and control socket at: the
    --disaggregation-host, else --host; a wildcard --host becomes this machine's address."""
    host = cfg.disaggregation.host or cfg.host
    if host in _WILDCARDS:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
        logger.warning(
            "--host is a wildcard: using %s for the KV data plane (set --disaggregation-host to choose the interface)",
            host,
        )
    return host


def bootstrap_host(cfg: ServerConfig) -> str:
    """Where a prefill's bootstrap server listens: --host when the deployment has an auth token;
    without one only the data-plane address, so an unauthenticated registry (which hands out KV
    buffer addresses and accepts registrations) is not on every interface."""
    return cfg.host if cfg.disaggregation.auth_token is not None else data_host(cfg)


def is_loopback(host: str) -> bool:
    """`host` (an address or a name) reaches this machine only: every address it resolves to is
    a loopback one."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in found)


def require_auth_off_loopback(cfg: ServerConfig, warn: bool = True) -> None:
    """PD without a token only on a loopback data plane, unless --disaggregation-insecure says
    otherwise (ConfigError naming the flags); a warning for what runs unauthenticated."""
    d = cfg.disaggregation
    if not d.enabled or d.auth_token is not None:
        return
    host = data_host(cfg)
    if not is_loopback(host) and not d.insecure:
        raise ConfigError(
            f"PD serving without an auth token on the non-loopback data-plane address {host}: anyone "
            "who reaches it could register as a prefill or read KV buffer addresses. Give every "
            f"prefill and decode server the same token (--disaggregation-auth-token-file or ${TOKEN_ENV}), "
            "or pass --disaggregation-insecure to serve unauthenticated anyway"
        )
    if not warn:
        return
    logger.warning(
        "PD without --disaggregation-auth-token-file (or $%s): bootstrap and control plane are "
        "unauthenticated and listen on the data-plane address %s only%s; set the same token on "
        "every prefill and decode server of the deployment",
        TOKEN_ENV,
        host,
        " (--disaggregation-insecure)" if d.insecure else "",
    )


def make_backend(cfg: ServerConfig) -> TransferBackend:
    """The configured transfer backend (registry.py), listening on the data-plane host when it
    crosses hosts."""
    d = cfg.disaggregation
    host = data_host(cfg) if backend_spec(d.transfer_backend).crosses_hosts else BackendOptions.host
    options = BackendOptions(host, d.ib_device, d.faults if d.faults.enabled else None)
    return open_backend(d.transfer_backend, options)


def register_pool(
    backend: TransferBackend, layout: KVLayout, state: StateLayout | None = None, draft: KVLayout | None = None
) -> None:
    """Expose every KV buffer of the rank's pool, its state buffers (hybrid models) and its draft
    model's KV buffers (STANDALONE speculative decoding) to the backend (once, at start). Aliased
    buffers (sliding and full layers over one tensor) are registered once: Mooncake refuses or
    double counts a region registered twice."""
    backend.register_many(*layout.unique_buffers())
    if draft is not None:
        backend.register_many(*draft.unique_buffers())
    if state is not None and state.num_linear:
        addrs, sizes = zip(*state.buffers())
        backend.register_many(list(addrs), list(sizes))


def rank_state_layout(cfg: ServerConfig, rank: int, pool: StatePool) -> StateLayout:
    """A hybrid model rank's state pool with the model's layer map (full layers keep the KV) and
    its linear heads (rank r of N holds the r-th N-th)."""
    mc = model_config_of(cfg.model_path)
    return StateLayout.from_pool(pool, mc.kv_layers, mc.num_layers, rank, cfg.tp_size)


def rank_layout(cfg: ServerConfig, rank: int, pool: KVPool, total_kv_heads: int) -> KVLayout:
    """A TP rank's pool as the transfer layer sees it: its KV head range among all KV heads."""
    start = ParallelConfig(cfg.tp_size, rank).kv_head_start(total_kv_heads)
    return KVLayout.from_pool(pool, start, total_kv_heads)
