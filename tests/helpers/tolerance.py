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
scale, as for bf16 at any depth): compare those runs by their own, coarser criterion.

Exactness checks of whole generations (PD against colocated, TP against TP 1, cache on against
off, chunked against whole) compare greedy tokens AND each token's logprob: assert_same_generations,
with a tolerance chosen by the Route the compared run took (same process, across processes or TP,
across devices), and a message naming the prompt, the first differing output position and the
size of the difference."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

GAIN = 32.0
# One binary against itself split over TP ranks (same kernels, same threads per process): only
# the order of the row-parallel projections' sums (an all-reduce of partial products instead of
# one GEMM's loop) and each rank's GEMM blocking change, about one rounding per reordered sum and
# nothing else; the TP-vs-TP-1 gains measured above stay below 0.4, so 1 leaves 2.5x of room.
SAME_BINARY_TP_GAIN = 1.0


class ModelShape(Protocol):
    """What the bound needs of a model's configuration (kvpipe's ModelConfig has both). Read-only
    properties, so frozen dataclasses match."""

    @property
    def num_layers(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...


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


# bf16 (weights and activations bf16, sums and norms in fp32, as HF computes in bf16): two correct
# implementations' fp32 sums differ in their last fp32 bits only, but each lands on one side of a
# bf16 rounding of its output, so an activation of either side may be one bf16 step (eps) off the
# other's wherever its fp32 value lies near a midpoint. That is a relative error of about eps per
# rounding, a few roundings a layer, passed on by every later layer, and the head's logits (kvpipe
# keeps them fp32, HF rounds them to bf16: half an eps more). So the bound is
#     atol = BF16_GAIN * eps(bf16) * max|expected| * (layers + 1),
# with no sqrt(width + positions): the reordered fp32 sums' own error (2^-24 per term) is far below
# one bf16 step. Measured against HF bf16 on the tiny parity models (3 layers, width 64): a gain of
# 0.5 on the dense families and 1.2 on Qwen3-MoE (a router score near a tie picks another expert in
# one of them); BF16_GAIN = 3 leaves 2.5x on that. It is 9% of the logits' scale at 3 layers: coarse,
# but still below a wrong RoPE or a dropped KV page (over a third of it and more).
BF16_GAIN = 3.0


def bf16_logit_atol(expected: torch.Tensor, shape: ModelShape) -> float:
    """The absolute tolerance of logits of a bf16 model against another bf16 implementation (HF
    transformers in bf16), as the comment above derives; refuses a bound that would check nothing."""
    scale = float(expected.detach().abs().max())
    atol = BF16_GAIN * torch.finfo(torch.bfloat16).eps * scale * (shape.num_layers + 1)
    if scale > 0 and atol >= 0.25 * scale:
        raise ValueError(f"a bf16 tolerance of {atol:.3g} on logits of scale {scale:.3g} would check nothing")
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


# ---- generations: two runs of the same prompts, token by token and logprob by logprob ----


class Route(enum.Enum):
    """How the compared generation reached its numbers, relative to the reference's: what decides
    the logprob tolerance of an exactness check (generation_atol)."""

    # Same process, same TP, same kernels: batching, chunking, page size, layer groups, a prefix
    # cache or a PD pair in one process change only how many rows a matmul gets and how the
    # attention walks the pages, so the same fp32 sums run in nearly the same order.
    SAME_PROCESS = "same process and TP"
    # Another TP size or another process (PD servers, TP workers, another thread count): an
    # all-reduce adds the ranks' partial sums in another order and each rank's matmuls block
    # differently, so every layer's output moves by a few fp32 roundings of its own size.
    ACROSS_PROCESSES = "across processes or TP"
    # Another device (CUDA against the CPU): other kernels for every op, the case logit_atol is
    # sized for; its bound for the tiny preset over ~170 positions is GAIN * (4 + 1) * sqrt(128 +
    # 170) ~ 2,800 roundings of the logits' scale.
    ACROSS_DEVICES = "across devices"


# The logprob bounds of each Route, in units of fp32 eps times the reference's largest |logprob|
# (at least 1). The logprob of a token is logit - logsumexp(logits): its rounding error follows
# the logits' scale, which the largest |logprob| of a random-weight model tracks (its logits spread
# over a few units). Measured on the context-dependent presets (scripts/exactness_drift.py: every
# family, batched, chunks of 7 to 100, pages of 1, layer groups, TP 2, against one prompt at a time;
# largest |logprob| about 3.9): at most 4.5e-6 (tiny-qwen3.5, layer groups), i.e. 10 roundings,
# TP 2 included. SAME_PROCESS: 64 roundings (3e-5 at that scale, 6x the largest measured).
# ACROSS_PROCESSES: 256 roundings (1.2e-4 there): other processes run other thread counts and TP
# all-reduces, which reorder every layer's sums; the same TP 2 runs stay below 4e-6 in one process.
# Both stay far below what a wrong KV page, head or state slot does on these presets (1e-1 and more:
# tests/unit/test_presets_context.py and the negative controls).
_ROUTE_ULPS = {Route.SAME_PROCESS: 64.0, Route.ACROSS_PROCESSES: 256.0, Route.ACROSS_DEVICES: 4096.0}


def generation_atol(route: Route, expected: Sequence[Generation]) -> float:
    """The largest |logprob difference| two correct generations of `route` may show."""
    scale = max([1.0, *(abs(x) for g in expected for x in g.logprobs)])
    return _ROUTE_ULPS[route] * torch.finfo(torch.float32).eps * scale


@dataclass(frozen=True)
class Generation:
    """One prompt's output: greedy token ids (or token texts, where an API gives no ids: OpenAI
    chat logprobs) and the logprob of each (fp32 in every engine)."""

    tokens: tuple[int | str, ...]
    logprobs: tuple[float, ...]

    @classmethod
    def of(cls, result: dict) -> Generation:
        """From an SGLang-shaped result: Engine.generate's (logprobs as floats) or a /generate
        response with return_logprob (triples [logprob, token id, text])."""
        lps = result["meta_info"]["output_token_logprobs"]
        return cls(
            tuple(result["output_ids"]), tuple(float(x[0]) if isinstance(x, list | tuple) else float(x) for x in lps)
        )

    @classmethod
    def of_req(cls, req: Any) -> Generation:
        """From a finished engine Req (its output_ids and output_logprobs)."""
        return cls(tuple(req.output_ids), tuple(req.output_logprobs))


def generation_difference(actual: Generation, expected: Generation, atol: float) -> str | None:
    """Where `actual` first leaves `expected` (a token, a missing logprob, or a logprob off by more
    than atol), in words; None when they agree."""
    if len(actual.logprobs) != len(actual.tokens):
        return f"{len(actual.logprobs)} logprobs for {len(actual.tokens)} tokens"
    for pos, (tok, want) in enumerate(zip(actual.tokens, expected.tokens)):
        if tok != want:
            before = max([abs(x - y) for x, y in zip(actual.logprobs[:pos], expected.logprobs[:pos])], default=0.0)
            return (
                f"token at output position {pos} is {tok} (logprob {actual.logprobs[pos]:.5g}), expected {want} "
                f"({expected.logprobs[pos]:.5g}); the logprobs before it differ by up to {before:.3g}"
            )
    if len(actual.tokens) != len(expected.tokens):
        return f"{len(actual.tokens)} tokens, expected {len(expected.tokens)}"
    for pos, (a, e) in enumerate(zip(actual.logprobs, expected.logprobs)):  # equal tokens: comparable
        if not abs(a - e) <= atol:  # NaN fails too
            worst = max(abs(x - y) for x, y in zip(actual.logprobs, expected.logprobs))
            return (
                f"logprob at output position {pos} is off by {abs(a - e):.3g} ({a:.7g} vs {e:.7g}; "
                f"atol {atol:.3g}, largest difference {worst:.3g})"
            )
    return None


def assert_same_generations(
    actual: Sequence[Generation],
    expected: Sequence[Generation],
    route: Route,
    prompts: Sequence[Sequence[int]] | None = None,
    what: str = "",
    atol_floor: float = 0.0,
) -> None:
    """Every actual generation has the expected tokens and logprobs within generation_atol(route)
    (or `atol_floor`, where a caller's mechanism allows more); the message names each failing
    prompt (index and length), its first differing output position and the size of the difference."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} generations, expected {len(expected)}"
    atol = max(generation_atol(route, expected), atol_floor)
    problems = []
    for i, (a, e) in enumerate(zip(actual, expected)):
        diff = generation_difference(a, e, atol)
        if diff is not None:
            size = f" ({len(prompts[i])} tokens)" if prompts is not None else ""
            problems.append(f"prompt {i}{size}: {diff}")
    if problems:  # one line per failing prompt
        raise AssertionError(f"{what + ': ' if what else ''}{route.value}: " + "\n  ".join(problems))


# ---- one matmul against an exact reference (quantized linear layers) ----


def matmul_bound(x: torch.Tensor, w_magnitude: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The largest error of a `dtype` matmul x [M, K] @ w^T [K, N] against the exact product, per
    output element [M, N]: the textbook worst-case bound for a sum of K products in any order,
    (K + 2) * eps * sum_k |x[m, k]| * |w[n, k]|, with two more roundings for forming each weight
    in the kernel (a dequantizing multiply, and an add where a zero point is added).
    `w_magnitude` [N, K]: a bound of what the kernel forms before rounding each weight (|w|, or
    |(q - 8) * scale| + |zero| for int4, where the two terms may cancel). Holds for every blocking
    and SIMD width; not a measurement."""
    k = x.shape[-1]
    eps = torch.finfo(dtype).eps
    return (k + 2) * eps * (x.double().abs() @ w_magnitude.double().abs().T)


def bf16_matmul_bound(x: torch.Tensor, w_magnitude: torch.Tensor) -> torch.Tensor:
    """matmul_bound for a kernel that takes x already rounded to bf16 (pass that x), may round
    each weight it forms to bf16, accumulates in fp32 and rounds its result to bf16: the fp32 sums'
    bound, plus one bf16 rounding (half its eps) of every weight's product term and of the result,
    whose size is at most sum_k |x| |w|."""
    half_ulp = torch.finfo(torch.bfloat16).eps / 2
    mag = x.double().abs() @ w_magnitude.double().abs().T
    return matmul_bound(x, w_magnitude) + 2 * half_ulp * mag
