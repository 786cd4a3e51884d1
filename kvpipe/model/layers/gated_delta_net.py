"""Gated DeltaNet token mixer (Qwen3.5 `linear_attn`), tensor-parallel by heads, over a StatePool.

    x [T, hidden] -> in_proj_qkv -> causal depthwise conv (kernel K) + silu -> q, k [T, Hk, Dk], v [T, Hv, Dv]
                  -> in_proj_b -> beta = sigmoid(b);  in_proj_a -> g = -exp(A_log) * softplus(a + dt_bias)
    gated delta rule (gated_delta_rule.py) -> o [T, Hv, Dv] -> RMSNorm(o) * silu(z) -> out_proj

Each request carries a conv state (its last K-1 conv inputs) and a recurrent state per layer in
its StatePool slot: a row with prefix_len 0 starts from zeros, any other row (a later chunk, a
decode step) from its slot, and the forward writes the slot back. TP: a rank holds Hk/tp key
heads and the Hv/tp value heads they serve; in_proj_qkv and the conv split into three head
ranges (q, k, v) each, out_proj is row-parallel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpipe.cache.recurrent_pool import StatePool, StateShape
from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.schema import HybridConfig, ModelConfig
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_step
from kvpipe.model.layers.linear import Linear, Shard

CHUNK = 64  # the chunked delta rule's block (HF's): snapshots reuse the states at its boundaries


def local_linear_heads(h: HybridConfig, parallel: ParallelConfig) -> tuple[int, int]:
    """(key heads, value heads) of the linear-attention layers one rank holds."""
    tp = parallel.tp_size
    if h.linear_key_heads % tp or h.linear_value_heads % tp:
        raise ConfigError(
            f"{h.linear_key_heads} linear-attention key heads / {h.linear_value_heads} value heads "
            f"do not split over tp_size={tp}"
        )
    if h.linear_value_heads % h.linear_key_heads:
        raise ConfigError(
            f"{h.linear_value_heads} linear value heads are not a multiple of {h.linear_key_heads} key heads"
        )
    return h.linear_key_heads // tp, h.linear_value_heads // tp


def local_state_shape(h: HybridConfig, parallel: ParallelConfig) -> StateShape:
    nk, nv = local_linear_heads(h, parallel)
    return StateShape(
        conv_dim=2 * nk * h.linear_key_head_dim + nv * h.linear_value_head_dim,
        conv_len=h.conv_kernel - 1,
        heads=nv,
        key_dim=h.linear_key_head_dim,
        value_dim=h.linear_value_head_dim,
    )


class GatedRMSNorm(nn.Module):
    """RMSNorm over one head's Dv, then times silu(gate) (HF Qwen3_5RMSNormGated: weight around 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


class CausalConv1d(nn.Module):
    """Depthwise conv weights [channels, 1, kernel], no bias (HF nn.Conv1d `conv1d`)."""

    def __init__(self, channels: int, kernel: int, shard: Shard | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.param_shards = {"weight": shard} if shard is not None else {}


class GatedDeltaNet(nn.Module):
    def __init__(
        self, cfg: ModelConfig, state_layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None
    ) -> None:
        """`state_layer`: this layer's buffer index in the StatePool (its rank among linear layers)."""
        super().__init__()
        h = cfg.hybrid
        assert h is not None
        self.state_layer = state_layer
        self.num_k_heads, self.num_v_heads = local_linear_heads(h, parallel)
        self.k_dim, self.v_dim = h.linear_key_head_dim, h.linear_value_head_dim
        self.kernel = h.conv_kernel
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim
        self.conv_dim = 2 * nk * dk + nv * dv
        tp = parallel.tp_size > 1
        k0, v0, key_dim = parallel.tp_rank * nk, parallel.tp_rank * nv, h.linear_key_heads * dk
        # in_proj_qkv rows (and conv channels) are [q | k | v] of all heads: a rank takes its heads of each
        qkv = (
            Shard(0, k0 * dk, nk * dk, more=((key_dim + k0 * dk, nk * dk), (2 * key_dim + v0 * dv, nv * dv)))
            if tp
            else None
        )
        self.in_proj_qkv = Linear(cfg.hidden_size, self.conv_dim, shard=qkv)
        self.in_proj_z = Linear(cfg.hidden_size, nv * dv, shard=Shard.rows(parallel, v0 * dv, nv * dv))
        self.in_proj_b = Linear(cfg.hidden_size, nv, shard=Shard.rows(parallel, v0, nv))
        self.in_proj_a = Linear(cfg.hidden_size, nv, shard=Shard.rows(parallel, v0, nv))
        self.conv1d = CausalConv1d(self.conv_dim, self.kernel, qkv)
        self.dt_bias = nn.Parameter(torch.empty(nv), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(nv), requires_grad=False)
        self.param_shards = {"dt_bias": Shard(0, v0, nv), "A_log": Shard(0, v0, nv)} if tp else {}
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = Linear(
            nv * dv, cfg.hidden_size, all_reduce=tp, group=group, shard=Shard.cols(parallel, v0 * dv, nv * dv)
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: StatePool) -> torch.Tensor:
        if batch.state_slots is None:
            raise ValueError("a hybrid model's forward needs ForwardBatch.state_slots")
        t = x.shape[0]
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x).view(t, self.num_v_heads, self.v_dim)
        beta = self.in_proj_b(x).sigmoid()  # [T, Hv]
        # fp32 before exp: in half precision A could overflow to inf
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, Hv]
        if batch.verify_states:
            o = self._verify(mixed, g, beta, batch, state)
        elif batch.decode is not None:
            o = self._decode(mixed, g, beta, batch, state)
        else:
            o = torch.empty(t, self.num_v_heads, self.v_dim, dtype=x.dtype, device=x.device)
            slots = batch.state_slots.tolist()  # one device sync per layer, not per row
            snaps = batch.state_snapshots or ((),) * len(batch.seqs)
            for s, slot, snap in zip(batch.seqs, slots, snaps):
                rows = slice(s.start, s.start + s.extend_len)
                o[rows] = self._prefill_row(mixed[rows], g[rows], beta[rows], s.prefix_len == 0, slot, state, snap)
        o = self.norm(o.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))
        return self.out_proj(o.view(t, self.num_v_heads * self.v_dim))

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, conv_dim] -> q, k [N, Hk, Dk], v [N, Hv, Dv]."""
        kd = self.num_k_heads * self.k_dim
        q, k, v = torch.split(conv_out, [kd, kd, self.num_v_heads * self.v_dim], dim=-1)
        n = conv_out.shape[0]
        return (
            q.reshape(n, self.num_k_heads, self.k_dim),
            k.reshape(n, self.num_k_heads, self.k_dim),
            v.reshape(n, self.num_v_heads, self.v_dim),
        )

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """window [B, C, K - 1 + E] (state then new inputs) -> silu(conv) [B, C, E]."""
        w = self.conv1d.weight
        return F.silu(F.conv1d(window.to(w.dtype), w, groups=self.conv_dim))

    def _prefill_row(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        fresh: bool,
        slot: int,
        state: StatePool,
        snapshots: tuple[tuple[int, int], ...] = (),
    ) -> torch.Tensor:
        """One sequence's E new tokens: mixed [E, C], g, beta [E, Hv] -> o [E, Hv, Dv]; its slot
        updated. `snapshots`: (k, dst) pairs, k in [1, E]: the state after the first k tokens also
        goes to slot dst. The row's own arithmetic stays that of one pass (its outputs do not depend
        on snapshots): the state at the last delta-rule chunk boundary (64 tokens) before k comes
        from that pass, and at most 63 more tokens are run again from there for k."""
        conv_buf, rec_buf = state.conv[self.state_layer], state.recurrent[self.state_layer]
        prev = torch.zeros_like(conv_buf[slot]) if fresh else conv_buf[slot]  # [C, K-1]
        window = torch.cat([prev, mixed.t().to(prev.dtype)], dim=1)  # [C, K-1+E]
        conv_buf[slot] = window[:, -(self.kernel - 1) :]
        out = self._conv(window[None])[0].t().to(mixed.dtype)  # [E, C]
        q, k, v = self._split(out)
        # the states at the chunk boundaries below each snapshot, filled by the pass
        keep: dict[int, torch.Tensor | None] | None = (
            {end // CHUNK: None for end, _ in snapshots} if snapshots else None
        )
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, None if fresh else rec_buf[slot], CHUNK, keep)
        for end, dst in snapshots:
            # after `end` tokens: the conv keeps inputs [end, end + K - 1) of the window
            conv_buf[dst] = window[:, end : end + self.kernel - 1]
            assert keep is not None
            at = end // CHUNK * CHUNK
            base = keep[end // CHUNK]  # the state after `at` tokens
            assert base is not None
            if end == at:
                rec_buf[dst] = base
            else:
                _, rec = chunk_gated_delta_rule(q[at:end], k[at:end], v[at:end], g[at:end], beta[at:end], base, CHUNK)
                rec_buf[dst] = rec
        rec_buf[slot] = final
        return o

    def _decode(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch, state: StatePool
    ) -> torch.Tensor:
        """One token per row, the whole batch at once: mixed [B, C] -> o [B, Hv, Dv]; slots updated."""
        slots = batch.state_slots
        assert slots is not None
        conv_buf, rec_buf = state.conv[self.state_layer], state.recurrent[self.state_layer]
        prev, rec = conv_buf.index_select(0, slots), rec_buf.index_select(0, slots)  # [B, C, K-1], [B, Hv, Dk, Dv]
        fresh = [i for i, s in enumerate(batch.seqs) if s.prefix_len == 0]  # one-token prompts
        if fresh:
            prev[fresh], rec[fresh] = 0, 0
        window = torch.cat([prev, mixed[:, :, None].to(prev.dtype)], dim=2)  # [B, C, K]
        conv_buf[slots] = window[:, :, 1:]
        q, k, v = self._split(self._conv(window)[:, :, 0].to(mixed.dtype))
        o, new = recurrent_gated_delta_step(q, k, v, g, beta, rec)
        rec_buf[slots] = new
        for row, snaps in enumerate(batch.state_snapshots or ()):
            for _, dst in snaps:  # k is 1: the state after this step
                conv_buf[dst], rec_buf[dst] = window[row, :, 1:], new[row]
        return o

    def _verify(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch, state: StatePool
    ) -> torch.Tensor:
        """A speculative verify: each row's inputs (its last token and drafts, prefix_len > 0) one
        position at a time, the rows side by side, with a decode step's arithmetic (so a verify
        computes each token as plain decoding would); mixed [T, C] -> o [T, Hv, Dv]. The state
        after each row's input j goes to StatePool.verify at (slot, j), the state after its last
        input to its slot; a snapshot (k, dst) takes the state after input k - 1."""
        keep = state.verify
        slots_t = batch.state_slots
        assert keep is not None and slots_t is not None, "a verify forward needs StatePool.verify and state slots"
        slots = slots_t.tolist()
        lens = [s.extend_len for s in batch.seqs]
        keep.check_rows(slots, lens)
        li = self.state_layer
        conv_buf, rec_buf = state.conv[li], state.recurrent[li]
        conv_keep, rec_keep = keep.conv[li], keep.recurrent[li]
        prev, rec = conv_buf.index_select(0, slots_t), rec_buf.index_select(0, slots_t)  # [B, C, K-1], [B, Hv, Dk, Dv]
        o = torch.empty(mixed.shape[0], self.num_v_heads, self.v_dim, dtype=mixed.dtype, device=mixed.device)
        starts = [s.start for s in batch.seqs]
        for j in range(max(lens)):
            rows = [b for b, n in enumerate(lens) if n > j]  # rows with an input at position j
            at = torch.tensor([starts[b] + j for b in rows], dtype=torch.int64, device=mixed.device)
            r = torch.tensor(rows, dtype=torch.int64, device=mixed.device)
            window = torch.cat([prev[r], mixed[at][:, :, None].to(prev.dtype)], dim=2)  # [R, C, K]
            q, k, v = self._split(self._conv(window)[:, :, 0].to(mixed.dtype))
            out, new = recurrent_gated_delta_step(q, k, v, g[at], beta[at], rec[r])
            o[at] = out
            prev[r], rec[r] = window[:, :, 1:], new
            at_slots = slots_t[r]
            conv_keep[at_slots, j], rec_keep[at_slots, j] = window[:, :, 1:], new
        conv_buf[slots_t], rec_buf[slots_t] = prev, rec
        for row, snaps in enumerate(batch.state_snapshots or ()):
            for n, dst in snaps:  # the state after the row's first n inputs
                conv_buf[dst], rec_buf[dst] = conv_keep[slots[row], n - 1], rec_keep[slots[row], n - 1]
        return o
