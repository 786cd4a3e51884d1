"""Adaptive layer grouping: cost model, estimators and the plain-path rules."""

from __future__ import annotations

import pytest

from kvpipe.disagg.layer_groups import (
    MAX_END_RUN,
    ComputeEstimator,
    LayerGroupPlanner,
    LayerGroupPolicy,
    LinkEstimator,
    predicted_ttft_ms,
    split_layers,
    tapered_split,
    tapered_splits,
)


def test_predicted_ttft_matches_the_two_regimes():
    # T < C: the last group's transfer is what stays exposed
    assert predicted_ttft_ms(100, 40, 4, 0) == pytest.approx(110)
    # T > C: the first group's compute is exposed, then the link is the bottleneck
    assert predicted_ttft_ms(40, 100, 4, 0) == pytest.approx(110)
    assert predicted_ttft_ms(100, 40, 1, 0) == pytest.approx(140)
    assert predicted_ttft_ms(100, 40, 4, 2.5) == pytest.approx(117.5)


def test_policy_parse():
    assert LayerGroupPolicy.parse("auto").fixed_groups is None
    assert LayerGroupPolicy.parse("3").fixed_groups == 3
    assert LayerGroupPolicy.parse(1).fixed_groups == 1
    with pytest.raises(ValueError):
        LayerGroupPolicy.parse("0")


def test_compute_estimator_interpolates_between_buckets():
    est = ComputeEstimator(ema=1.0)
    assert est.ms_per_layer(100) is None
    est.observe(tokens=256, layers=4, ms=4 * 256 * 0.01)  # 0.01 ms per layer-token
    est.observe(tokens=1024, layers=4, ms=4 * 1024 * 0.03)
    assert est.ms_per_layer(256) == pytest.approx(2.56)
    assert est.ms_per_layer(1024) == pytest.approx(30.72)
    mid = est.ms_per_layer(640)  # between buckets 256 and 1024: per-token rate interpolated
    assert 0.01 * 640 < mid < 0.03 * 640
    assert est.ms_per_layer(64) == pytest.approx(0.01 * 64)  # below: nearest bucket's rate


def test_link_estimator_ema():
    link = LinkEstimator(ema=0.5)
    assert link.transfer_ms(1000) is None
    link.observe(1000, 1.0)
    link.observe(3000, 1.0)
    assert link.bytes_per_ms == pytest.approx(2000)
    assert link.transfer_ms(4000) == pytest.approx(2.0)


def _planner(**kw) -> LayerGroupPlanner:
    pl = LayerGroupPlanner(LayerGroupPolicy(**kw), num_layers=12)
    pl.compute.observe(tokens=2048, layers=12, ms=1200.0)  # C = 1200 ms at 2048 tokens
    pl.link.observe(nbytes=1_000_000, ms=1.0)  # 1 MB/ms
    return pl


def test_plain_path_for_short_prompts_and_without_estimates():
    assert _planner().choose(tokens=100, kv_bytes=10**9).groups == 1
    assert _planner().choose(tokens=100, kv_bytes=10**9).reason == "short"
    cold = LayerGroupPlanner(LayerGroupPolicy(), num_layers=12)
    assert cold.choose(tokens=4096, kv_bytes=10**9).reason == "no-estimate"


def _mean_ttft(t_ms: float, n: int, bounds=None, scales=(0.8, 1.0, 1.25)) -> float:
    """What the planner minimises: predicted TTFT (C = 1200 ms, 12 layers) averaged over T's scales."""
    return sum(predicted_ttft_ms(1200, t_ms * s, n, 1.0, num_layers=12, bounds=bounds) for s in scales) / len(scales)


def test_cost_model_pipelines_when_transfer_is_comparable_to_compute():
    pl = _planner(group_overhead_ms=1.0)
    ch = pl.choose(tokens=2048, kv_bytes=1_200_000_000)  # T = 1200 ms = C
    # T = C: the link is busy from the first group's KV to the last, so the largest group's
    # transfer stays exposed whatever the shape: one group per layer exposes one layer's
    # transfer (100 ms) for 11 overheads
    assert ch.reason == "cost-model" and ch.groups == 12 and ch.bounds is None
    assert ch.predicted_ms == pytest.approx(1200 + 100 + 11 * 1.0)
    assert ch.predicted_ms < 0.6 * predicted_ttft_ms(ch.compute_ms, ch.transfer_ms, 1, 1.0)
    assert pl.last is ch
    # at most 8 groups of 12 layers: a 2-layer group stays (200 ms exposed at T = C exactly, as
    # with 6 equal groups); the shape kept has single layers at both ends, which holds up better
    # when T is 20-25% off its estimate than 6 equal groups (their fewer overheads win only at T = C)
    ch = _planner(group_overhead_ms=1.0, max_groups=8).choose(tokens=2048, kv_bytes=1_200_000_000)
    assert ch.groups == 8 and ch.bounds is not None
    sizes = [e - s for s, e in ch.bounds]
    assert max(sizes) == 2 and sizes[0] == sizes[-1] == 1, sizes
    assert ch.predicted_ms == pytest.approx(1200 + 200 + 7 * 1.0)
    assert _mean_ttft(1200, 8, ch.bounds) < _mean_ttft(1200, 6)
    assert predicted_ttft_ms(1200, 1200, 6, 1.0, num_layers=12) < ch.predicted_ms


def test_estimates_that_may_be_off_favour_the_finer_shape():
    # T = 0.7 C: at the estimate, 6 groups ending in two single layers expose one layer's
    # transfer like 12 groups do, for fewer overheads; with T 25% higher their 3-layer groups'
    # KV queues up to the end, so the planner keeps one group per layer
    ch = _planner(group_overhead_ms=1.0).choose(tokens=2048, kv_bytes=840_000_000)
    coarse = min(
        (b for n in range(4, 9) for b in tapered_splits(12, n)),
        key=lambda b: predicted_ttft_ms(1200, 840, len(b), 1.0, num_layers=12, bounds=b),
    )
    assert predicted_ttft_ms(1200, 840, len(coarse), 1.0, num_layers=12, bounds=coarse) < ch.predicted_ms
    assert ch.groups == 12
    assert _mean_ttft(840, 12) < _mean_ttft(840, len(coarse), coarse)
    assert predicted_ttft_ms(1200, 1050, 12, 1.0, num_layers=12) < predicted_ttft_ms(
        1200, 1050, len(coarse), 1.0, num_layers=12, bounds=coarse
    )


def test_the_choice_is_kept_per_rounded_ratio():
    pl = _planner(group_overhead_ms=1.0)
    a = pl.choose(tokens=2048, kv_bytes=1_080_000_000)
    b = pl.choose(tokens=2048, kv_bytes=1_081_000_000)  # T/C 0.9 and 0.9008: the same shape
    assert (a.groups, a.bounds) == (b.groups, b.bounds) and len(pl._shapes) == 1
    assert b.transfer_ms == pytest.approx(1081.0)  # predicted with the estimate itself
    with pytest.raises(ValueError):
        LayerGroupPolicy(ratio_scales=())


def test_tapered_split_where_the_ends_matter():
    # T = 0.9 C, at most 8 groups: equal groups of 12 layers expose a 2-layer group's transfer at
    # the end; 1,2,2,1,2,2,1,1-style shapes expose one layer's; the simulation picks a tapered one
    pl = _planner(group_overhead_ms=1.0, max_groups=8)
    ch = pl.choose(tokens=2048, kv_bytes=1_080_000_000)  # T = 1080 ms, C = 1200 ms
    assert ch.reason == "cost-model" and ch.bounds is not None and ch.bounds[-1] == (11, 12)
    assert ch.groups == len(ch.bounds) <= 8
    assert ch.predicted_ms < predicted_ttft_ms(1200, 1080, 6, 1.0, num_layers=12)


def test_no_gain_keeps_the_plain_path():
    pl = _planner()
    ch = pl.choose(tokens=2048, kv_bytes=10_000)  # T = 0.01 ms: nothing to hide
    assert ch.groups == 1 and ch.reason == "no-gain"


def test_overhead_limits_the_group_count():
    pl = _planner(group_overhead_ms=110.0, max_groups=12)
    ch = pl.choose(tokens=2048, kv_bytes=600_000_000)  # T = 600 ms, C = 1200 ms
    # gain of one more group is T/N - T/(N+1): 100 ms from 2 to 3 groups, under the 110 it costs
    assert ch.groups == 2


def test_fixed_groups_capped_by_layers():
    assert LayerGroupPlanner(LayerGroupPolicy(fixed_groups=20), 12).choose(10, 10).groups == 12
    assert LayerGroupPlanner(LayerGroupPolicy(fixed_groups=1), 12).choose(10**5, 10**12).groups == 1


def test_simulated_pipeline_matches_the_closed_form_for_equal_groups():
    for c, t, n in [(100, 40, 4), (40, 100, 4), (120, 120, 6), (90, 10, 3)]:
        assert predicted_ttft_ms(c, t, n, 1.5, num_layers=12) == pytest.approx(predicted_ttft_ms(c, t, n, 1.5))


def test_uneven_split_exposes_its_largest_last_group():
    assert [e - s for s, e in split_layers(12, 8)] == [2, 1, 1, 2, 2, 1, 1, 2]
    assert split_layers(4, 9) == ((0, 1), (1, 2), (2, 3), (3, 4))  # at most one group per layer
    # T < C: the last group (2 of 12 layers) stays exposed, as with 6 groups, not T/8
    assert predicted_ttft_ms(1200, 600, 8, 0, num_layers=12) == pytest.approx(1200 + 600 * 2 / 12)
    assert predicted_ttft_ms(1200, 600, 8, 0, num_layers=12) > predicted_ttft_ms(1200, 600, 8, 0)


def test_tapered_split_has_one_layer_at_each_end():
    assert [e - s for s, e in tapered_split(12, 7) or ()] == [1, 2, 2, 2, 2, 2, 1]
    assert [e - s for s, e in tapered_split(12, 4) or ()] == [1, 5, 5, 1]
    assert tapered_split(12, 2) is None  # no middle
    assert tapered_split(12, 12) is None  # the equal split already is one layer per group
    assert tapered_split(4, 3) is None  # 1,2,1 is what split_layers makes
    assert tapered_split(3, 4) is None  # more groups than layers
    for n in range(3, 12):
        b = tapered_split(12, n)
        if b is not None:
            assert len(b) == n and b[0] == (0, 1) and b[-1] == (11, 12)
            assert all(x[1] == y[0] for x, y in zip(b, b[1:]))


def test_tapered_splits_have_runs_of_single_layers_at_the_ends():
    shapes = {tuple(e - s for s, e in b) for b in tapered_splits(12, 7)}
    assert (1, 2, 2, 2, 2, 2, 1) in shapes
    assert any(sh[:3] == (1, 1, 1) and sh[3] > 1 for sh in shapes) and any(sh[-4:] == (2, 1, 1, 1) for sh in shapes)
    assert all(sum(sh) == 12 and len(sh) == 7 for sh in shapes)
    assert tuple(e - s for s, e in split_layers(12, 7)) not in shapes  # the equal split is not repeated
    assert tapered_splits(12, 12) == [] and tapered_splits(12, 1) == []
    assert len(tapered_splits(80, 8)) == (MAX_END_RUN + 1) ** 2 - 1


@pytest.mark.parametrize(("t_ms", "runs_at"), [(1320, "head"), (1080, "tail")])
def test_near_t_equal_c_the_planner_uses_end_runs(t_ms: float, runs_at: str) -> None:
    # C = 1200 ms over 12 layers. T 10% above C: after a one-layer first group the link idles
    # until a larger second group is computed, unless it is small too. T 10% below C: the
    # larger groups' KV queues up behind the last compute unless the last ones are small.
    ch = _planner(group_overhead_ms=1.0, max_groups=8).choose(tokens=2048, kv_bytes=int(t_ms * 1e6))
    assert ch.bounds is not None
    sizes = [e - s for s, e in ch.bounds]
    assert (sizes[:2] if runs_at == "head" else sizes[-2:]) == [1, 1], sizes
    one_each_end = min(
        predicted_ttft_ms(1200, t_ms, n, 1.0, num_layers=12, bounds=b)
        for n in range(3, 9)
        if (b := tapered_split(12, n)) is not None
    )
    assert ch.predicted_ms < one_each_end


def test_planner_tapers_at_either_end():
    # T far below C, costly groups: an 11,1 split exposes one layer's transfer (the first
    # group's 110 ms hide behind the last layer's compute) for one overhead, cheaper than two
    # equal groups (half the transfer exposed) and than 1,10,1 (two overheads)
    pl = _planner(group_overhead_ms=20.0)
    ch = pl.choose(tokens=2048, kv_bytes=120_000_000)  # T = 120 ms, C = 1200 ms
    assert ch.reason == "cost-model" and ch.bounds == ((0, 11), (11, 12))
    assert ch.predicted_ms == pytest.approx(1100 + 110 + 10 + 20.0)
    # T far above C: the link is the bottleneck; what an equal split exposes is its first
    # group's compute before the link has anything, so the first group is one layer
    pl = _planner(group_overhead_ms=1.0, max_groups=8)
    ch = pl.choose(tokens=2048, kv_bytes=4_800_000_000)  # T = 4800 ms
    assert ch.reason == "cost-model" and ch.bounds is not None and ch.bounds[0] == (0, 1)
    assert ch.predicted_ms == pytest.approx(
        predicted_ttft_ms(1200, 4800, ch.groups, 1.0, num_layers=12, bounds=ch.bounds)
    )
    assert ch.predicted_ms < predicted_ttft_ms(1200, 4800, 6, 1.0, num_layers=12)


def test_at_t_equal_c_only_the_largest_group_matters():
    # every group's transfer waits for its compute and the next compute waits for nothing:
    # finish = C + the largest group's transfer, whatever the order of sizes
    assert predicted_ttft_ms(1200, 1200, 7, 0, num_layers=12, bounds=tapered_split(12, 7)) == pytest.approx(1400)
    assert predicted_ttft_ms(1200, 1200, 6, 0, num_layers=12) == pytest.approx(1400)
    assert predicted_ttft_ms(1200, 1200, 12, 0, num_layers=12) == pytest.approx(1300)
