"""How many layer groups a prefill batch runs as, for layer-pipelined KV transfer.

Plain Python, no tensors: the prefill engine feeds measurements in and asks for a choice.

Cost model (docs/architecture.md, layer-pipelined transfer; SGLang's open layer-wise PRs). With
compute C for the whole forward, transfer T for the batch's KV and N equal groups, the last group's
KV leaves after all compute, and each group's transfer waits for its compute, so

    TTFT(N) ≈ max(C + T/N, C/N + T) + (N - 1) · overhead

(`overhead`: the fixed cost of one more group — planning, submitting, polling). T is the batch's
bytes on the wire: KV per token of the layers that keep KV (a hybrid model's full-attention
layers only; a sliding-window model's sliding layers only for the prompt's window pages,
transfer/planning/wire_bytes.py) plus, once per request in its last forward, a hybrid model's recurrent state
(LayerPipeline.begin). N = 1 is the plain
path. We pick the N with the smallest predicted TTFT and keep the plain path unless pipelining
saves at least `min_gain` of the plain TTFT: a short prompt never pays for groups it cannot use.

Equal groups are not the best split where T ≈ C: the link is busy from the first group's KV to
the last, so what stays exposed is the first group's compute (before the link has anything) or
the last group's transfer (after the compute is done), whichever regime holds. A tapered split
(one layer at each end, the rest near-equal: 12 layers in 7 groups are 1,2,2,2,2,2,1) halves
that exposed end for one more group's overhead. One layer at an end is not always enough: with
T a little above C, a first group of one layer leaves the link idle until the (larger) second
group is computed; with T a little below C, the larger groups' KV queues up behind the last
compute (measured, issue 34: 380 ms left after the forward at N = 7 where one layer's transfer is
205 ms). So tapered splits have up to MAX_END_RUN single-layer groups at each end. The planner
simulates every shape for every N (`predicted_ttft_ms` with `bounds`) and keeps the cheapest.

The estimates are not exact: the link's rate and the CPU's speed drift (±25% between minutes on
the 2-core Xeon of issue 34), and a shape that is best at the estimated T/C can be much worse a
little off it: 2-layer groups tie with one-layer groups at T/C 0.7 in the model, but where the
link is 25% slower than estimated their KV queues up to the end (measured: 496 ms left after the
forward against 271 for twelve one-layer groups at T/C 0.86). So a shape is judged by its mean
predicted TTFT over T scaled by `LayerGroupPolicy.ratio_scales` (0.8, 1, 1.25), which prefers the
finer shapes that hold up either way, and each group's fixed cost still bounds the count. The
best shape depends only on T/C and overhead/C (the model scales linearly in time), so it is
computed once per (T/C, overhead/C) rounded to 1% and kept.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from kvpipe.config import parse_layer_groups
from kvpipe.engine.model_runner import split_layers


@dataclass(frozen=True)
class LayerGroupPolicy:
    fixed_groups: int | None = None  # None: adaptive; 1: plain path always; N: always N groups
    max_groups: int = 16  # capped by the layer count
    min_tokens: int = 128  # below this many prompt tokens in the batch: plain path
    min_gain: float = 0.05  # pipelining must save this fraction of the plain TTFT
    group_overhead_ms: float = 1.0  # fixed cost of one more group
    ema: float = 0.3  # weight of a new measurement in the running estimates
    # scales of the estimated transfer a shape's predicted TTFT is averaged over (module doc)
    ratio_scales: tuple[float, ...] = (0.8, 1.0, 1.25)

    def __post_init__(self) -> None:
        if not self.ratio_scales or min(self.ratio_scales) <= 0:
            raise ValueError(f"ratio_scales must be positive, got {self.ratio_scales!r}")

    @classmethod
    def parse(cls, value: str | int) -> LayerGroupPolicy:
        """`auto` or a positive group count (the --disaggregation-layer-groups flag)."""
        n = parse_layer_groups(value)
        return cls() if n == "auto" else cls(fixed_groups=int(n))


Bounds = tuple[tuple[int, int], ...]  # [start, end) layer ranges of a batch's groups, in order


MAX_END_RUN = 3  # single-layer groups at either end of a tapered split, at most


def tapered_split(num_layers: int, num_groups: int, head: int = 1, tail: int = 1) -> Bounds | None:
    """`head` single-layer groups first and `tail` last, the layers between in the remaining groups
    near-equal; None where that is no different from `split_layers` or impossible."""
    inner_groups, inner_layers = num_groups - head - tail, num_layers - head - tail
    if min(head, tail) < 0 or head + tail == 0 or inner_groups < 1 or inner_layers < inner_groups:
        return None
    inner = tuple((s + head, e + head) for s, e in split_layers(inner_layers, inner_groups))
    first = tuple((i, i + 1) for i in range(head))
    last = tuple((i, i + 1) for i in range(num_layers - tail, num_layers))
    bounds = (*first, *inner, *last)
    return None if bounds == split_layers(num_layers, num_groups) else bounds


def tapered_splits(num_layers: int, num_groups: int) -> list[Bounds]:
    """Every distinct tapered split of `num_layers` into `num_groups` groups with up to MAX_END_RUN
    single-layer groups at each end. Where T > C per layer the link idles after a small first
    group unless the next ones are small too; where T < C a backlog of larger groups' KV reaches
    past the last compute unless the last ones are small: which runs pay depends on T/C, so the
    planner simulates them all (at most 15 shapes per group count)."""
    seen: dict[Bounds, None] = {}
    for head in range(MAX_END_RUN + 1):
        for tail in range(MAX_END_RUN + 1):
            b = tapered_split(num_layers, num_groups, head, tail)
            if b is not None:
                seen.setdefault(b)
    return list(seen)


def predicted_ttft_ms(
    compute_ms: float,
    transfer_ms: float,
    groups: int,
    overhead_ms: float,
    num_layers: int | None = None,
    bounds: Bounds | None = None,
) -> float:
    """Prefill compute plus the transfer left after it, for `groups` layer groups.

    Without `num_layers` the groups are equal (the closed form above). With it, the groups are
    `bounds` or else those `split_layers` makes (12 layers in 8 groups: sizes 2,1,1,2,2,1,1,2),
    and the pipeline is simulated: group k's KV leaves once group k is computed and group k-1's
    KV has left, so a split whose last group is larger exposes more than T/N. Compute and
    transfer are spread over the layers evenly (every layer of a model has the same shape)."""
    n = max(1, groups)
    if num_layers is None:
        return max(compute_ms + transfer_ms / n, compute_ms / n + transfer_ms) + (n - 1) * overhead_ms
    split = bounds if bounds is not None else split_layers(num_layers, n)
    c_done = t_done = 0.0
    for start, end in split:
        frac = (end - start) / num_layers
        c_done += compute_ms * frac
        t_done = max(t_done, c_done) + transfer_ms * frac
    return t_done + (len(split) - 1) * overhead_ms


class ComputeEstimator:
    """Running estimate of forward milliseconds per layer as a function of batch tokens.

    Kept per power-of-two token bucket (attention makes cost superlinear in tokens); a query
    between measured buckets interpolates linearly, outside them it scales from the nearest one.
    """

    def __init__(self, ema: float = 0.3) -> None:
        self.ema = ema
        self._buckets: dict[int, float] = {}  # bucket tokens -> ms per layer per token

    @staticmethod
    def _bucket(tokens: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(tokens, 1))))

    def observe(self, tokens: int, layers: int, ms: float) -> None:
        if tokens <= 0 or layers <= 0 or ms <= 0:
            return
        b, per = self._bucket(tokens), ms / (layers * tokens)
        old = self._buckets.get(b)
        self._buckets[b] = per if old is None else (1 - self.ema) * old + self.ema * per

    def ms_per_layer(self, tokens: int) -> float | None:
        if not self._buckets or tokens <= 0:
            return None
        keys = sorted(self._buckets)
        i = bisect.bisect_left(keys, tokens)
        if i == 0:
            return self._buckets[keys[0]] * tokens
        if i == len(keys):
            return self._buckets[keys[-1]] * tokens
        lo, hi = keys[i - 1], keys[i]
        w = (tokens - lo) / (hi - lo)
        return ((1 - w) * self._buckets[lo] + w * self._buckets[hi]) * tokens


class LinkEstimator:
    """Running estimate of transfer goodput (bytes per millisecond) from finished transfers."""

    def __init__(self, ema: float = 0.3) -> None:
        self.ema = ema
        self.bytes_per_ms: float | None = None

    def observe(self, nbytes: int, ms: float) -> None:
        if nbytes <= 0 or ms <= 0:
            return
        rate = nbytes / ms
        self.bytes_per_ms = rate if self.bytes_per_ms is None else (1 - self.ema) * self.bytes_per_ms + self.ema * rate

    def transfer_ms(self, nbytes: int) -> float | None:
        return None if self.bytes_per_ms is None else nbytes / self.bytes_per_ms


@dataclass(frozen=True)
class GroupChoice:
    groups: int
    reason: str  # "fixed" | "short" | "no-estimate" | "no-gain" | "cost-model"
    compute_ms: float | None = None
    transfer_ms: float | None = None
    predicted_ms: float | None = None
    # the groups' layer ranges when not split_layers(num_layers, groups) (a tapered split)
    bounds: Bounds | None = None


# (T/C, overhead/C, cap) rounded -> (groups, bounds or None, expected TTFT / plain's)
_Shape = tuple[int, "Bounds | None", float]
MAX_CACHED_SHAPES = 4096


class LayerGroupPlanner:
    def __init__(self, policy: LayerGroupPolicy, num_layers: int) -> None:
        self.policy = policy
        self.num_layers = num_layers
        self.compute = ComputeEstimator(policy.ema)
        self.link = LinkEstimator(policy.ema)
        self.last: GroupChoice = GroupChoice(1, "no-estimate")
        self._shapes: dict[tuple[float, float, int], _Shape] = {}

    def best_shape(self, ratio: float, overhead: float, cap: int) -> _Shape:
        """The split with the least mean predicted TTFT over `policy.ratio_scales`, for transfer
        `ratio` x compute and per-group `overhead` x compute (compute = 1): equal groups first,
        then fewer groups on ties. Returns (groups, bounds, its mean TTFT / the plain path's)."""
        key = (round(ratio, 2), round(overhead, 5), cap)
        hit = self._shapes.get(key)
        if hit is not None:
            return hit
        r, ov, scales, n_layers = key[0], key[1], self.policy.ratio_scales, self.num_layers

        def expected(n: int, b: Bounds | None) -> float:
            return sum(predicted_ttft_ms(1.0, r * s, n, ov, n_layers, b) for s in scales) / len(scales)

        splits: list[tuple[int, Bounds | None]] = [(n, None) for n in range(1, cap + 1)]
        splits += [(n, b) for n in range(2, cap + 1) for b in tapered_splits(n_layers, n)]
        cost = [(expected(n, b), n, b is not None, b) for n, b in splits]
        best_ms, best, _, bounds = min(cost, key=lambda x: x[:3])
        if len(self._shapes) >= MAX_CACHED_SHAPES:
            self._shapes.clear()
        shape = self._shapes[key] = (best, bounds, best_ms / cost[0][0])
        return shape

    def choose(self, tokens: int, kv_bytes: int) -> GroupChoice:
        """Groups for a prefill batch of `tokens` new tokens whose KV is `kv_bytes` on the wire."""
        p, cap = self.policy, max(1, min(self.policy.max_groups, self.num_layers))
        if p.fixed_groups is not None:
            choice = GroupChoice(min(p.fixed_groups, self.num_layers), "fixed")
        elif tokens < p.min_tokens:
            choice = GroupChoice(1, "short")
        else:
            per_layer, t = self.compute.ms_per_layer(tokens), self.link.transfer_ms(kv_bytes)
            if per_layer is None or t is None:
                choice = GroupChoice(1, "no-estimate")
            else:
                c = per_layer * self.num_layers
                n, bounds, rel = self.best_shape(t / c, p.group_overhead_ms / c, cap)
                if n == 1 or rel > 1 - p.min_gain:
                    choice = GroupChoice(1, "no-gain", c, t, predicted_ttft_ms(c, t, 1, p.group_overhead_ms))
                else:
                    ms = predicted_ttft_ms(c, t, n, p.group_overhead_ms, self.num_layers, bounds)
                    choice = GroupChoice(n, "cost-model", c, t, ms, bounds)
        self.last = choice
        return choice
