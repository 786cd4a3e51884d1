"""The gated delta rule (Gated DeltaNet linear attention) in plain torch, fp32 as HF computes it.

Per value head the state S [Dk, Dv] evolves token by token as
    S <- exp(g_t) * S;  S <- S + k_t (beta_t * (v_t - k_t^T S))^T;  o_t = q_t^T S
with q, k L2-normalised and q scaled by Dk^-0.5. Two forms, operation for operation as
transformers' torch fallbacks (modeling_qwen3_5.py) so logits match to fp32 rounding:
- `chunk_gated_delta_rule`: a prefill (chunk) of one sequence, chunks of 64 tokens solved with a
  triangular system, then a short scan over chunks;
- `recurrent_gated_delta_step`: one token for each of B sequences (a decode step), batched.
The seam for a fused kernel (fla's chunk_gated_delta_rule / fused_recurrent) is these two functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _expand_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each q/k head serves num_v_heads // num_k_heads consecutive value heads (dim -2 is heads)."""
    rep = num_v_heads // k.shape[-2]
    if rep == 1:
        return q, k
    return q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
    keep: dict[int, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of T tokens. q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay, <= 0), beta: [T, Hv];
    initial_state: [Hv, Dk, Dv] fp32, None for zeros. Returns o [T, Hv, Dv] (v's dtype) and the
    final state [Hv, Dk, Dv] fp32. `keep`: a dict whose keys are whole chunk counts i (i * chunk_size
    <= T): filled with the state after the first i * chunk_size tokens (the scan passes them anyway)."""
    out_dtype = v.dtype
    t, hv, dv = v.shape
    dk = k.shape[-1]
    q, k = _expand_heads(q, k, hv)
    # [1, H, T, D] fp32, as HF lays them out
    q, k, v, beta, g = [
        x.transpose(0, 1)[None].to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, beta, g)
    ]
    q, k = l2norm(q), l2norm(k)
    q = q * dk**-0.5
    pad = (chunk_size - t % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    # [1, H, n_chunks, C, D]
    q, k, k_beta, v_beta = [x.reshape(1, hv, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    g = g.reshape(1, hv, -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)  # log of the decay from the chunk start to each position
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [1, H, n, C, C]
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp()[..., None]
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    state = (
        torch.zeros(1, hv, dk, dv, dtype=torch.float32, device=q.device)
        if initial_state is None
        else initial_state[None].to(torch.float32)
    )
    o = torch.zeros_like(new_v)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    if keep is not None and 0 in keep:
        keep[0] = state[0].clone()
    for i in range(q.shape[2]):
        v_new = new_v[:, :, i] - k_cumdecay[:, :, i] @ state
        o[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
        if keep is not None and i + 1 in keep:
            keep[i + 1] = state[0]
    o = o.reshape(1, hv, -1, dv)[:, :, :t]
    return o[0].transpose(0, 1).to(out_dtype, memory_format=torch.contiguous_format), state[0]


def recurrent_gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences. q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv];
    state: [B, Hv, Dk, Dv] fp32. Returns o [B, Hv, Dv] (v's dtype) and the new state (fp32)."""
    out_dtype = v.dtype
    q, k = _expand_heads(q, k, v.shape[1])
    q, k, v, beta, g = (x.to(torch.float32) for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    state = state.to(torch.float32) * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(dim=-2)  # [B, Hv, Dv]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    o = (state * q[..., None]).sum(dim=-2)
    return o.to(out_dtype), state
