"""Layer-pipelined KV transfer (F5): greedy outputs (tokens and logprobs) with the prefill forward
split into layer groups, each group's KV handed to the sender as it finishes, equal the colocated
engine's; fixed
group counts and the adaptive choice, chunked prefill on and off, batches mixing long and short
prompts. In-process over the `local` backend (see test_pd_inprocess.py), plus one run through
sglang-router with Mooncake. Every wait is bounded; nothing is timed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvpipe.disagg.layer_groups import ComputeEstimator, GroupChoice, LinkEstimator
from kvpipe.engine.model_runner import split_layers
from kvpipe.engine.request import FinishReason
from tests.helpers.pd_pair import GREEDY, PS, Pair, Reference, assert_pd_matches, make_pair, prompts
from tests.helpers.pd_stack import generate, greedy, start_stack
from tests.helpers.tolerance import Generation, Route, assert_same_generations

LAYERS = 4  # the tiny preset
MIXED = [1, 17, 40, 100, 333, 250]  # one batch (or a few chunks) of long and short prompts


def spy_sends(pair: Pair) -> list[dict[str, Any]]:
    """Record every send() the prefill engine makes (the real sender still does the work)."""
    calls: list[dict[str, Any]] = []
    real = pair.sender.send

    def send(room, t0, t1, layer_start=0, layer_end=None, **kw):
        calls.append(
            {
                "room": room,
                "tokens": (t0, t1),
                "layers": (layer_start, layer_end or LAYERS),
                "last": kw.get("last", False),
            }
        )
        return real(room, t0, t1, layer_start, layer_end, **kw)

    pair.sender.send = send  # type: ignore[method-assign]
    return calls


def check_outputs(pair: Pair, reqs, ps, reference: Reference) -> None:
    assert all(d.finish_reason is FinishReason.LENGTH for _, d in reqs), [d.finish_detail for _, d in reqs]
    assert_pd_matches([d for _, d in reqs], ps, reference)
    st = pair.prefill.stats()["disaggregation"]
    assert st["rooms_succeeded"] >= len(reqs) and st["rooms_failed"] == 0


@pytest.mark.parametrize("groups,chunk", [(2, 0), (2, 24), (3, 24), (4, 0)])
def test_fixed_groups_match_colocated(tiny_model_dir, reference, groups, chunk):
    ps = prompts(groups * 10 + chunk, MIXED)
    with make_pair(tiny_model_dir, chunk, layer_groups=groups) as pair:
        calls = spy_sends(pair)
        reqs = [pair.reqs(ids) for ids in ps]
        pair.run(reqs)
        check_outputs(pair, reqs, ps, reference)
        assert set(pair.pipeline.counters.batches_by_groups) == {groups}
        want = set(split_layers(LAYERS, groups))
        for p, _ in reqs:
            mine = [c for c in calls if c["room"] == p.bootstrap_room]
            # every chunk went out group by group, then one final flush with the aux
            by_chunk: dict[tuple[int, int], list] = {}
            for c in mine[:-1]:
                by_chunk.setdefault(c["tokens"], []).append(c["layers"])
            assert all(v == sorted(want) for v in by_chunk.values()), by_chunk
            bounds = sorted(by_chunk)
            assert bounds[0][0] == 0 and bounds[-1][1] == len(p.input_ids)
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # chunks tile the prompt
            assert mine[-1]["last"] and not any(c["last"] for c in mine[:-1])
        pair.settle()


def test_uneven_groups_match_colocated(tiny_model_dir, reference):
    """Groups of unequal sizes (what the planner's tapered splits make on deeper models) run and
    ship exactly the layers they name."""
    bounds = ((0, 2), (2, 3), (3, 4))  # not split_layers(4, 3), which is 1,2,1
    assert bounds != split_layers(LAYERS, 3)
    ps = prompts(7, MIXED)
    with make_pair(tiny_model_dir, 24) as pair:
        planner = pair.pipeline.planner
        planner.choose = lambda tokens, kv_bytes: GroupChoice(3, "cost-model", bounds=bounds)  # type: ignore[method-assign]
        calls = spy_sends(pair)
        reqs = [pair.reqs(ids) for ids in ps]
        pair.run(reqs)
        check_outputs(pair, reqs, ps, reference)
        for p, _ in reqs:
            mine = [c for c in calls if c["room"] == p.bootstrap_room]
            by_chunk: dict[tuple[int, int], list] = {}
            for c in mine[:-1]:
                by_chunk.setdefault(c["tokens"], []).append(c["layers"])
            assert by_chunk and all(v == list(bounds) for v in by_chunk.values()), by_chunk
        pair.settle()


def test_group_kv_lands_while_later_groups_compute(tiny_model_dir, reference):
    """With the decode's destination known, group 1's KV reaches the decode before the last group
    of the same forward runs."""
    ids = prompts(5, [300])[0]
    with make_pair(tiny_model_dir, layer_groups=2) as pair:
        p, d = pair.reqs(ids)
        pair.decode.add_request(d)
        book = pair.sender._book  # noqa: SLF001 - wait until the decode's TransferRequest is in
        end = time.monotonic() + 20
        while not (p.bootstrap_room in book.rooms and book.rooms[p.bootstrap_room].dests):
            assert time.monotonic() < end, "the decode never sent its TransferRequest"
            pair.decode.step()
            time.sleep(0.01)
        model, seen = pair.prefill.runner.model, []
        real = model.forward_layers

        def forward_layers(hidden, fb, pool, start, end_):
            if start > 0:  # group 2: wait (bounded) for group 1's writes to complete
                stop = time.monotonic() + 10
                while pair.sender.stats.bytes_written == 0 and time.monotonic() < stop:
                    time.sleep(0.005)
                seen.append(pair.sender.stats.bytes_written)
            return real(hidden, fb, pool, start, end_)

        model.forward_layers = forward_layers  # type: ignore[method-assign]
        pair.run([(p, None)], until=lambda: p.finished)
        pair.run([], until=lambda: d.finished)
        model.forward_layers = real  # type: ignore[method-assign]
        layer_bytes = (len(ids) // PS) * PS * pair.layout.token_nbytes // LAYERS  # full pages, 1 layer
        assert seen and seen[0] >= 2 * layer_bytes  # layers 0-1, full pages, before layer 2 ran
        assert_pd_matches([d], [ids], reference)
        pair.settle()


def inject_slow_link(pair: Pair, tokens: int, ms_per_layer: float) -> None:
    """Model a link whose transfer of `tokens` tokens takes as long as their compute (T/C = 1);
    ema 0 keeps the injected estimates fixed while real measurements come in."""
    planner = pair.pipeline.planner
    planner.compute = ComputeEstimator(ema=0.0)
    planner.compute.observe(tokens, LAYERS, ms_per_layer * LAYERS)
    planner.link = LinkEstimator(ema=0.0)
    planner.link.observe(tokens * pair.layout.token_nbytes, ms_per_layer * LAYERS)


@pytest.mark.parametrize("chunk", [0, 512])  # chunks of 512: the first is long enough to pipeline
def test_auto_pipelines_long_prompts_on_a_slow_link(tiny_model_dir, reference, chunk):
    with make_pair(tiny_model_dir, chunk) as pair:  # --disaggregation-layer-groups auto (the default)
        calls = spy_sends(pair)
        warm = [pair.reqs(ids) for ids in prompts(1, [40, 700])]
        pair.run(warm)  # real estimates; no link estimate before the first room landed: plain path
        assert pair.pipeline.counters.reasons["no-estimate"] >= 1
        inject_slow_link(pair, 600, ms_per_layer=10.0)
        ps = prompts(2, [600, 30, 90])  # mixed: one long prompt, two short ones, one batch
        reqs = [pair.reqs(ids) for ids in ps]
        calls.clear()
        pair.run(reqs)
        check_outputs(pair, reqs + warm, ps + prompts(1, [40, 700]), reference)
        pipe = pair.pipeline
        chosen = [g for g in pipe.counters.batches_by_groups if g > 1]
        assert chosen and pipe.counters.reasons["cost-model"] >= 1
        assert any(c["layers"] != (0, LAYERS) for c in calls if c["room"] == reqs[0][0].bootstrap_room)
        # a short prompt alone takes the plain path: no per-group sends
        short = pair.reqs(prompts(3, [50])[0])
        calls.clear()
        pair.run([short])
        assert pipe.last.reason == "short" and pipe.last.groups == 1
        assert [c["layers"] for c in calls] == [(0, LAYERS)] and calls[0]["last"]
        assert_pd_matches([short[1]], [short[0].input_ids], reference)
        s = pair.prefill.stats()
        assert s["num_groups"] == 1 and s["layer_groups_reason"] == "short"
        assert sum(s["layer_group_batches"].values()) == sum(pipe.counters.batches_by_groups.values())
        assert s["disaggregation"]["layer_groups"]["link_goodput_gbps"] > 0
        # every room that succeeded reported how long its KV kept landing after its forward
        assert s["transfer_tail_count"] == s["disaggregation"]["rooms_succeeded"] == 6
        assert s["transfer_tail_ms_sum"] >= 0
        pair.settle()


def test_router_with_forced_groups(tiny_model_dir: Path, tmp_path: Path, reference) -> None:
    pytest.importorskip("mooncake.engine")
    ps = prompts(4, [3, 129, 700, 1500])
    s = start_stack(
        tiny_model_dir,
        tmp_path,
        "--page-size",
        str(PS),
        "--max-total-tokens",
        "8192",
        "--chunked-prefill-size",
        "512",
        "--disaggregation-layer-groups",
        "3",
    )
    try:
        body = {"sampling_params": greedy(GREEDY.max_new_tokens), "return_logprob": True}
        got = [Generation.of(generate(s.router, {**body, "input_ids": ids})) for ids in ps]
        # the servers against this process's colocated engine: Route.ACROSS_PROCESSES
        assert_same_generations(got, [reference(ids) for ids in ps], Route.ACROSS_PROCESSES, ps, s.logs())
        info = s.prefill.get("/server_info").json()["internal_states"][0]
        assert info["num_groups"] == 3 and info["layer_groups_reason"] == "fixed"
        metrics = s.prefill.get("/metrics").text
        assert "kvpipe_num_layer_groups 3.0" in metrics
        assert 'kvpipe_prefill_batches_by_layer_groups_total{groups="3"}' in metrics
    finally:
        s.close()
