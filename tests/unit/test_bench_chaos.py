"""`kvpipe bench chaos` without processes: the seeded round plan, in-flight bookkeeping, the table."""

from __future__ import annotations

from collections import Counter

import pytest

from kvpipe.harness.outcome import End, Outcome
from kvpipe.launch.stack import PARTS
from kvpipe.qa.chaos_load import Sent, generate
from kvpipe.qa.chaos_plan import TP_CHILD, ChaosConfig, Phase, plan_rounds
from kvpipe.qa.chaos_report import summarize, table
from kvpipe.qa.chaos_round import RoundResult


def test_plan_pairs_every_part_with_every_phase_evenly() -> None:
    plan = plan_rounds(ChaosConfig(rounds=18, seed=3))
    assert Counter(plan) == {(t, p): 2 for t in PARTS for p in Phase}
    assert plan == plan_rounds(ChaosConfig(rounds=18, seed=3))  # seeded
    assert plan != plan_rounds(ChaosConfig(rounds=18, seed=4))


def test_plan_adds_tp_rounds_only_with_a_tp_side() -> None:
    plan = plan_rounds(ChaosConfig(rounds=20, seed=0, tp_side="prefill", tp_rounds=2))
    assert len(plan) == 20 and sum(t == TP_CHILD for t, _ in plan) == 2
    assert Counter(t for t, _ in plan if t != TP_CHILD) == {"prefill": 6, "decode": 6, "router": 6}
    assert all(t != TP_CHILD for t, _ in plan_rounds(ChaosConfig(rounds=20, tp_rounds=2)))


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError):
        ChaosConfig(rounds=0)
    with pytest.raises(ValueError):
        ChaosConfig(tp_side="router")


def test_in_flight_means_started_before_and_not_ended_by_the_kill() -> None:
    done = Sent("load", start=1.0, outcome=Outcome(generate([5, 6], 8), End.OK, 1.0, 2.0, 2))
    running = Sent("probe", start=3.0)
    assert not done.in_flight_at(2.5) and done.in_flight_at(1.5)
    assert running.in_flight_at(4.0) and not running.in_flight_at(2.0)
    assert running.describe() == "probe: running" and done.describe() == "load: ok"


def test_a_round_with_a_hang_or_a_leak_is_not_ok() -> None:
    good = RoundResult(
        1,
        "decode",
        Phase.DECODE,
        restart_s=3.0,
        first_success_s=4.0,
        serves_again=True,
        inflight=Counter({"connection_error": 2}),
    )
    assert good.ok
    assert not RoundResult(2, "router", Phase.BOOTSTRAP, restart_s=1.0, serves_again=True, hung=["probe: running"]).ok
    assert not RoundResult(
        3, "prefill", Phase.TRANSFER, restart_s=1.0, serves_again=True, leaks=["decode: pages held 4"]
    ).ok
    s = summarize(ChaosConfig(rounds=1), [good], None)
    assert (s["rounds_ok"], s["leaks_found"], s["inflight"], s["kills"]) == (
        1,
        0,
        {"connection_error": 2},
        {"decode/decode": 1},
    )
    assert "1/1 rounds ok" in table(s)


def test_the_command_is_registered() -> None:
    from kvpipe.cli import build_parser

    parser, runners = build_parser(["bench", "chaos"])
    args = parser.parse_args(["bench", "chaos", "--rounds", "4", "--tp-side", "decode"])
    assert ("bench", "chaos") in runners and (args.rounds, args.tp_side) == (4, "decode")
