"""Owns one rank's model shard and KV pool; turns a ForwardSpec into logits.

The same runner runs on every TP rank; only rank 0 samples from what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kvpipe.cache.kv_dtype import is_fp8, kv_storage_dtype
from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool
from kvpipe.config import CacheConfig, ConfigError, SchedulerConfig, ServerConfig
from kvpipe.engine.batch import ForwardSpec
from kvpipe.engine.connector import EngineRole
from kvpipe.model.families.causal_lm import LMBase
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.gated_delta_net import local_state_shape

# (start, end, batch): layers [start, end) of this forward have written their KV into the pool (the
# last of them may still be computing its attention and MLP: _EarlyGroup)
GroupCallback = Callable[[int, int, ForwardBatch], None]


class _EarlyGroup:
    """Fires a layer group's callback as soon as its last layer's K/V are in the pool (from the
    attention, ForwardBatch.kv_stored), not after that layer's attention and MLP: the group's KV
    goes on the wire while its last layer still computes, which shortens what is left to send
    after the forward by most of a layer's compute (issue 34). `finish` fires it after the group
    if no store reported it (a layer without a KV store of its own)."""

    def __init__(self, callback: GroupCallback, start: int, end: int, fb: ForwardBatch) -> None:
        self.callback, self.start, self.end, self.fb = callback, start, end, fb
        self.fired = False

    def stored(self, layer: int) -> None:
        if layer == self.end - 1:
            self.finish()

    def finish(self) -> None:
        if not self.fired:
            self.fired = True
            self.callback(self.start, self.end, self.fb)


def make_kv_pool(
    model: LMBase,
    num_pages: int,
    page_size: int,
    device: str | torch.device = "cpu",
    window_tables: bool = True,
    kv_cache_dtype: str = "auto",
) -> KVPool:
    """The KV pool one rank of `model` needs: its KV heads only (one replicated head when tp_size >
    KV heads), or the MLA latent (one buffer per layer, whole on every rank); sliding-window
    layers share their tensors with full ones (cache/kv_pool.py), and every forward must then carry
    their own page tables (ForwardBatch.swa); window_tables=False: one table for all layers.
    kv_cache_dtype (--kv-cache-dtype): what the pool stores; an fp8 pool takes the model's
    per-layer scales (its checkpoint's, else 1.0)."""
    cfg = model.cfg
    model_dtype = next(model.parameters()).dtype
    dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
    scales = model.kv_scales if is_fp8(dtype) else None
    # one buffer per layer that keeps KV: every layer, or a hybrid model's full-attention layers
    swa = tuple(i for i, layer in enumerate(cfg.kv_layers) if window_tables and cfg.window(layer) is not None)
    return KVPool(
        len(cfg.kv_layers),
        num_pages,
        page_size,
        model.local_kv_heads,
        cfg.kv_cache_head_dim,
        dtype,
        device,
        latent=cfg.mla is not None,
        swa_layers=swa,
        compute_dtype=model_dtype,
        k_scales=None if scales is None else scales.k,
        v_scales=None if scales is None else scales.v,
    )


def make_state_pool(model: LMBase, num_slots: int, device: str | torch.device = "cpu") -> StatePool | None:
    """The recurrent-state pool of a hybrid model's linear-attention layers (this rank's heads);
    None for a model without them."""
    h = model.cfg.hybrid
    if h is None or not h.linear_layers:
        return None
    dtype = next(model.parameters()).dtype
    return StatePool(h.linear_layers, num_slots, local_state_shape(h, model.parallel), dtype, device)


def state_slots(cache: CacheConfig, scheduler: SchedulerConfig) -> int:
    """Recurrent-state slots of a hybrid model: --max-state-slots, else one per running request."""
    return cache.max_state_slots or scheduler.max_running_requests


def snapshot_slots(cfg: ServerConfig, role: EngineRole) -> int:
    """State slots after the running requests' where a hybrid model's prefix cache keeps its
    snapshots (kvpipe/cache/hybrid_radix_cache.py): --max-mamba-cache-size minus the running slots,
    else 2 per running slot (3 state slots per request in all, SGLang's no_buffer sizing); 0 without
    the cache, and where the engine's role keeps no snapshots (a PD decode never computes a
    prompt: its cache keeps KV alone and the prefill sends the final state)."""
    if not cfg.cache.radix_cache or not role.state_snapshots:
        return 0
    running = state_slots(cfg.cache, cfg.scheduler)
    if cfg.cache.max_mamba_cache_size is None:
        return 2 * running
    if cfg.cache.max_mamba_cache_size <= running:
        raise ConfigError(
            f"--max-mamba-cache-size {cfg.cache.max_mamba_cache_size} leaves no state slot for prefix-cache "
            f"snapshots beside the {running} running requests' (raise it, or --disable-radix-cache)"
        )
    return cfg.cache.max_mamba_cache_size - running


def split_layers(num_layers: int, num_groups: int) -> tuple[tuple[int, int], ...]:
    """[start, end) ranges of `num_groups` near-equal contiguous layer groups."""
    n = max(1, min(num_groups, num_layers))
    bounds = [round(i * num_layers / n) for i in range(n + 1)]
    return tuple((bounds[i], bounds[i + 1]) for i in range(n))


class ModelRunner:
    def __init__(
        self,
        model: LMBase,
        cache: CacheConfig,
        device: str | torch.device = "cpu",
        scheduler: SchedulerConfig = SchedulerConfig(),
        snapshot_slots: int = 0,
        verify_positions: int = 0,
    ) -> None:
        """`snapshot_slots`: hybrid models' state slots for prefix-cache snapshots, after the
        running requests' ones. `verify_positions`: speculative decoding's inputs per verify row
        (max drafts + 1): a hybrid model keeps that many states per running slot."""
        self.model = model
        self.device = torch.device(device)
        self.page_size = cache.page_size
        self.pool = make_kv_pool(
            model, cache.pages(), cache.page_size, self.device, kv_cache_dtype=cache.kv_cache_dtype
        )
        self.state_pool = make_state_pool(model, state_slots(cache, scheduler) + snapshot_slots, self.device)
        if self.state_pool is not None and verify_positions > 0:
            self.state_pool.keep_verify_states(state_slots(cache, scheduler), verify_positions)
        # the NEXTN drafter (engine/spec/mtp_drafter.py) reads each forward's last hidden states, after
        # the final norm ([T, hidden], every row), from last_hidden; off: nothing is kept
        self.capture_hidden = False
        self.last_hidden: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.model.cfg.num_layers

    def take_hidden(self) -> torch.Tensor:
        """The last forward's hidden states (capture_hidden on), handed over once."""
        h, self.last_hidden = self.last_hidden, None
        if h is None:
            raise RuntimeError("no hidden states captured (capture_hidden is off, or they were taken)")
        return h

    def build_batch(self, spec: ForwardSpec) -> ForwardBatch:
        tables = [torch.from_numpy(t) for t in spec.page_tables]
        if self.pool.swa_layers and spec.swa_page_tables is None:
            raise ValueError("a pool whose sliding layers share tensors needs their page tables in every forward")
        swa = None if spec.swa_page_tables is None else [torch.from_numpy(t) for t in spec.swa_page_tables]
        fb = ForwardBatch.build(
            [list(t) for t in spec.token_ids],
            list(spec.prefix_lens),
            tables,
            self.page_size,
            list(spec.want_logits),
            None if spec.state_slots is None else list(spec.state_slots),
            swa,
            self.model.cfg.sliding_window,
            logit_counts=None if spec.logit_counts is None else list(spec.logit_counts),
            state_snapshots=list(spec.state_snapshots) or None,
            verify_states=spec.verify_states,
        )
        return fb if self.device.type == "cpu" else fb.to(self.device)

    def _groups(self, spec: ForwardSpec) -> tuple[tuple[int, int], ...]:
        groups = spec.layer_groups or ((0, self.num_layers),)
        flat = [b for g in groups for b in g]
        ok = (
            flat[0] == 0
            and flat[-1] == self.num_layers
            and all(groups[i][1] == groups[i + 1][0] for i in range(len(groups) - 1))
            and all(s < e for s, e in groups)
        )
        if not ok:
            raise ValueError(f"layer groups {groups} do not tile [0, {self.num_layers})")
        return groups

    @torch.inference_mode()
    def run(self, spec: ForwardSpec, on_group_done: GroupCallback | None = None) -> torch.Tensor | None:
        """Forward the batch (layer group by layer group). Returns fp32 logits [B_out, V] for
        rows with want_logits (in row order; spec.logit_counts[i] rows of row i, a verify), or
        None when no row wants them."""
        fb = self.build_batch(spec)
        if spec.state_commits:  # the last verify's accepted states, before anything reads the slots
            assert self.state_pool is not None
            self.state_pool.commit_verify(spec.state_commits)
        if spec.state_restores:  # cached prefixes' states into their requests' slots (hybrid models)
            assert self.state_pool is not None
            src, dst = zip(*spec.state_restores)
            self.state_pool.copy_slots(list(src), list(dst))
        callback = on_group_done
        hidden = self.model.embed(fb)  # [T, hidden]
        for start, end in self._groups(spec):
            if self.state_pool is None:
                early = _EarlyGroup(callback, start, end, fb) if callback is not None else None
                group_fb = fb if early is None else replace(fb, kv_stored=early.stored)
                hidden = self.model.forward_layers(hidden, group_fb, self.pool, start, end)
                if early is not None:
                    early.finish()
            else:  # a hybrid model's group holds recurrent state too, final only at the group's end
                hidden = self.model.forward_layers(hidden, fb, self.pool, start, end, self.state_pool)
                if callback is not None:
                    callback(start, end, fb)
        if self.capture_hidden:
            self.last_hidden = self.model.norm(hidden)
        if not any(spec.want_logits):
            return None
        return self.model.compute_logits(hidden, fb)
