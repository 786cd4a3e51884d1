"""The torch thread plan of a server (--cpu-threads, TP split, affinity default) and the flag."""

from __future__ import annotations

import pytest

from kvpipe.cli import build_parser
from kvpipe.commands.flags import server_config_from_args
from kvpipe.config import ConfigError, ServerConfig
from kvpipe.engine.cpu_threads import ThreadSource, format_cores, plan_cpu_threads


def test_flag_splits_among_tp_ranks() -> None:
    p = plan_cpu_threads(4, 2, (0, 1, 2, 3))
    assert (p.per_rank, p.tp_size, p.total, p.source, p.interop) == (2, 2, 4, ThreadSource.FLAG, 1)
    assert plan_cpu_threads(5, 2, (0, 1)).per_rank == 2  # the remainder is left idle
    assert plan_cpu_threads(1, 4, (0, 1)).per_rank == 1  # never below one thread per rank


def test_default_is_the_affinity_split_among_ranks() -> None:
    p = plan_cpu_threads(None, 1, (3, 1))
    assert (p.per_rank, p.source, p.cores) == (2, ThreadSource.AFFINITY, (1, 3))
    assert plan_cpu_threads(None, 2, (0, 1, 2, 3)).per_rank == 2
    assert plan_cpu_threads(None, 4, (0,)).per_rank == 1


def test_flag_may_exceed_the_cores() -> None:
    # the user's choice stands (e.g. a cpuset that grows later); only its split is ours
    assert plan_cpu_threads(8, 1, (0,)).per_rank == 8


@pytest.mark.parametrize("threads, tp", [(0, 1), (-1, 1), (1, 0)])
def test_bad_values_are_refused(threads: int, tp: int) -> None:
    with pytest.raises(ValueError):
        plan_cpu_threads(threads, tp, (0,))


def test_report_and_log_line() -> None:
    p = plan_cpu_threads(None, 2, (0, 1, 2, 3))
    assert p.as_dict() == {
        "per_rank": 2,
        "tp_size": 2,
        "total": 4,
        "interop": 1,
        "source": "affinity",
        "affinity": [0, 1, 2, 3],
    }
    line = p.describe()
    assert "\n" not in line and "2 intra-op per TP rank x 2" in line and "0-3" in line


def test_format_cores() -> None:
    assert format_cores((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert format_cores((4,)) == "4"
    assert format_cores(()) == ""


def test_cli_flag_reaches_the_server_config() -> None:
    def cfg(*flags: str) -> ServerConfig:
        argv = ["serve", *flags]
        parser, _ = build_parser(argv)
        return server_config_from_args(parser.parse_args(argv))

    assert cfg().cpu_threads is None
    assert cfg("--cpu-threads", "3").cpu_threads == 3
    with pytest.raises(SystemExit, match="cpu-threads"):
        cfg("--cpu-threads", "0")
    with pytest.raises(ConfigError):
        ServerConfig(model_path="m", cpu_threads=0)


def test_servers_prefer_passive_omp_wait_unless_chosen() -> None:
    from kvpipe.engine.cpu_threads import OMP_WAIT_ENV, prefer_passive_omp_wait

    env: dict[str, str] = {}
    assert prefer_passive_omp_wait(env) == "PASSIVE" and env == {OMP_WAIT_ENV: "PASSIVE"}
    chosen = {OMP_WAIT_ENV: "ACTIVE"}
    assert prefer_passive_omp_wait(chosen) == "ACTIVE" and chosen == {OMP_WAIT_ENV: "ACTIVE"}


@pytest.mark.parametrize(("argv", "policy"), [(["serve", "--help"], "PASSIVE"), (["bench", "engine", "--help"], None)])
def test_kvpipe_serve_sets_the_policy_before_torch_loads(
    argv: list[str], policy: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvpipe serve` (what launch and the benchmarks start) sets it in its environment before it
    imports the server; other commands (the engine benchmark) keep libgomp's default."""
    import os

    from kvpipe.cli import main

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(SystemExit):
        main(argv)
    assert os.environ.get("OMP_WAIT_POLICY") == policy
