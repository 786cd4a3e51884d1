"""How close two computations of the same logits must be: a bound derived from the dtype, the
magnitude of the reference logits and the size of the computation, not from one CPU's rounding.
It serves as well for what a model computes on the way to its logits (a layer's KV, an MLA
latent, a recurrent state): the bound for the whole depth holds for every layer.

Two correct implementations of a model (kvpipe against HF transformers, TP ranks against TP 1,
a packed batch against one sequence alone) perform the same arithmetic in a different order:
other kernels, other blockings of each matmul, other SIMD widths (AVX2 sums 8 lanes at a time,
AVX-512 16), other summation orders in an all-reduce. Each reordered sum of n terms is off by
about sqrt(n) roundings of its own magnitude (a random walk of eps-sized steps); every layer
runs such sums over the width of the model and over the context, and the final projection onto
the vocabulary adds one more. So the logits of two correct runs differ by about

    atol = GAIN * eps(dtype) * max|expected| * (layers + 1) * sqrt(width + positions)

where `layers` is the model's depth, `width` its hidden size and `positions` the longest
context any compared logit saw; GAIN is what the network itself does to a rounding error (norms
rescale it, softmax and the gated delta-net's exp() amplify it). rtol is 0: a logit's error
follows the scale of its row, not its own value (a logit near 0 is as far off as a large one).

GAIN = 32 comes from measurements on both CPU kinds this project runs on (fp32). The largest
difference seen was 1.16e-4 on an Intel Xeon with AVX-512, in the tiny Qwen3.5's packed-batch
parity test (4 layers, width 64, at most 12 positions, max|logit| about 2.8: a gain of about 8);
an AMD EPYC with AVX2 reached 5.3e-5 on the same model over 90 positions (a gain of 1.9), and
the dense, MLA, GPT-OSS and MoE families stay below a gain of 0.3 there. For those tests the
bound is 3.2e-4 to 4.5e-4 (packed batch: at least 2.7x the Intel difference), 8.9e-4 (the
90-position hybrid runs: 17x the AMD one) and 4.7e-4 (the dense 3-layer parity models). TP
ranks against TP 1 differ by at most 7e-6 in logits and 2.5e-6 in KV there (gain below 0.4).

It stays tight enough for real bugs, which change these logits by far more (measured on the same
tiny models): a wrong RoPE (llama3 scaling left out) 1.5, a dropped KV page 1.2, a missing
attention sink 2.0, a missing dt_bias in the delta-net 2.8 -- over 1000x the bound; even RoPE
frequencies off by 0.1% (1e-2) or an RMSNorm epsilon 10x too large (2.9e-3) are 6x to 20x
above it. What it cannot see is a change within rounding noise, which no fixed atol sees either.

The bound refuses to be used where it would check nothing (at or above a tenth of the logits'
scale, as for bf16 at any depth): compare those runs by their own, coarser criterion."""

from __future__ import annotations

import math
from typing import Protocol

import torch

GAIN = 32.0
# One binary against itself split over TP ranks (same kernels, same threads per process): only
# the order of the row-parallel projections' sums (an all-reduce of partial products instead of
# one GEMM's loop) and each rank's GEMM blocking change, about one rounding per reordered sum and
# nothing else; the TP-vs-TP-1 gains measured above stay below 0.4, so 1 leaves 2.5x of room.
SAME_BINARY_TP_GAIN = 1.0


class ModelShape(Protocol):
    """What the bound needs of a model's configuration (kvpipe's ModelConfig has both)."""

    num_layers: int
    hidden_size: int


def logit_atol(
    expected: torch.Tensor,
    shape: ModelShape,
    positions: int,
    dtype: torch.dtype = torch.float32,
    gain: float = GAIN,
) -> float:
    """The absolute tolerance of logits computed in `dtype` by a model of `shape` over contexts of
    up to `positions` tokens, around the reference `expected` (see the module's docstring).
    `gain`: GAIN for two implementations; SAME_BINARY_TP_GAIN for one binary split over TP ranks."""
    scale = float(expected.detach().abs().max())
    steps = (shape.num_layers + 1) * math.sqrt(shape.hidden_size + positions)
    atol = gain * torch.finfo(dtype).eps * scale * steps
    if scale > 0 and atol >= 0.1 * scale:
        raise ValueError(f"a tolerance of {atol:.3g} on logits of scale {scale:.3g} would check nothing ({dtype})")
    return atol


def logits_close(
    actual: torch.Tensor, expected: torch.Tensor, shape: ModelShape, positions: int, dtype: torch.dtype = torch.float32
) -> bool:
    """Whether `actual` is within logit_atol of `expected`: for checks that a change is real."""
    atol = logit_atol(expected, shape, positions, dtype)
    return bool((actual.float() - expected.float()).abs().max() <= atol)


def assert_close_logits(
    actual: torch.Tensor,
    expected: torch.Tensor,
    shape: ModelShape,
    positions: int,
    dtype: torch.dtype = torch.float32,
    msg: str | None = None,
) -> None:
    """torch.testing.assert_close of two runs' logits with logit_atol (rtol 0); the message names
    the bound."""
    atol = logit_atol(expected, shape, positions, dtype)
    torch.testing.assert_close(
        actual,
        expected,
        atol=atol,
        rtol=0,
        msg=lambda m: (
            f"{msg + ': ' if msg else ''}{m}\n(logit_atol {atol:.3g}: {shape.num_layers} layers, "
            f"width {shape.hidden_size}, {positions} positions, {dtype})"
        ),
    )
