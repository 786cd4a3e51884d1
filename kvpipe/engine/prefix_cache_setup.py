"""Which prefix (radix) cache an engine keeps: by the model (sliding window, hybrid recurrent
state, plain attention) and by what its connector lets it do (EngineRole)."""

from __future__ import annotations

import logging

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.cache.recurrent_pool import StatePool
from kvpipe.cache.recurrent_slots import StateSlotAllocator
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.config import ServerConfig
from kvpipe.engine.connector import EngineRole
from kvpipe.engine.model_runner import snapshot_slots, state_slots
from kvpipe.model.checkpoint.schema import ModelConfig

logger = logging.getLogger(__name__)


def sliding_window(model: ModelConfig) -> int | None:
    """The window of a model's sliding layers (tokens); None without any."""
    return model.sliding_window if model.sliding_layers else None


def make_prefix_cache(
    cfg: ServerConfig, model: ModelConfig, role: EngineRole, state_pool: StatePool | None
) -> RadixCache | None:
    """The engine's prefix cache (None: off). `state_pool`: a hybrid model's recurrent-state pool
    (rank 0's), whose slots past the running requests' hold the cache's snapshots."""
    if not (cfg.cache.radix_cache and role.prefix_cache):
        return None
    hybrid = model.hybrid is not None
    # state snapshots where prompts are computed (colocated, PD prefill)
    num_snapshots = snapshot_slots(cfg, role) if hybrid else 0
    # a PD decode never computes a prompt: its cache needs only the KV of a prefix (the prefill
    # sends the KV past it and the prompt's final state whole), so a plain RadixCache
    kv_only = hybrid and role.kv_only_prefix_cache
    if hybrid and num_snapshots == 0 and not kv_only:
        logger.info(
            "prefix caching (radix cache) is disabled for the hybrid model %s: no state snapshot "
            "slots (a connector other than PD's, or --max-mamba-cache-size)",
            cfg.model_path,
        )
        return None
    page_size = cfg.cache.page_size
    # sliding layers keep only their window's pages (scheduler.py): their prefix cache keeps
    # window pages where a hit may start, tombstones where they slid out (cache/swa_radix_cache.py)
    window = sliding_window(model)
    if window is not None:
        return SWARadixCache(page_size, window)
    if not num_snapshots:
        return RadixCache(page_size)
    running = state_slots(cfg.cache, cfg.scheduler)
    split = cfg.cache.mamba_scheduler_strategy != "no_buffer"
    cache = HybridRadixCache(page_size, StateSlotAllocator(num_snapshots, running), split)
    assert state_pool is not None and state_pool.num_slots == running + num_snapshots
    logger.info(
        "hybrid prefix cache: %d state snapshots of %d bytes each (--max-mamba-cache-size %d)",
        num_snapshots,
        state_pool.slot_nbytes,
        running + num_snapshots,
    )
    return cache
