"""--disaggregation-* flags -> DisaggregationConfig (one config for the servers and the transfer layer, with its
transfer tuning and fault injection as parts of their own); refusals."""

from __future__ import annotations

import pytest

from kvpipe.cli import build_parser
from kvpipe.commands.flags import server_config_from_args
from kvpipe.config import ConfigError, DisaggregationConfig, FaultInjection, ServerConfig, TransferTuning
from kvpipe.disagg.setup import data_host, make_backend
from kvpipe.transfer.backends import BACKENDS, BackendOptions, check_backend, open_backend


def parse(*flags: str) -> ServerConfig:
    argv = ["serve", "--model-path", "m", *flags]
    parser, _ = build_parser(argv)
    return server_config_from_args(parser.parse_args(argv))


def test_flags_map_onto_the_configs() -> None:
    cfg = parse(
        "--disaggregation-mode",
        "decode",
        "--disaggregation-bootstrap-port",
        "9000",
        "--disaggregation-ib-device",
        "mlx5_0",
        "--disaggregation-host",
        "10.99.0.2",
        "--disaggregation-bootstrap-timeout",
        "3",
        "--disaggregation-waiting-timeout",
        "7",
        "--disaggregation-heartbeat-interval",
        "0.25",
        "--disaggregation-heartbeat-max-failure",
        "3",
        "--disaggregation-transfer-timeout",
        "4",
        "--disaggregation-failure-prob",
        "0.5",
        "--disaggregation-failure-seed",
        "9",
        "--disaggregation-layer-groups-min-tokens",
        "100",
        "--host",
        "0.0.0.0",
    )
    d = cfg.disaggregation
    assert (d.mode, d.bootstrap_port, d.ib_device, d.host, d.faults) == (
        "decode",
        9000,
        "mlx5_0",
        "10.99.0.2",
        FaultInjection(prob=0.5, seed=9),
    )
    t = cfg.disaggregation
    assert (t.bootstrap_timeout_s, t.waiting_timeout_s, t.heartbeat_interval_s, t.transfer_timeout_s) == (3, 7, 0.25, 4)
    assert (t.heartbeat_misses, t.heartbeat_timeout_s, t.layer_groups_min_tokens) == (3, 0.75, 100)
    assert t.tuning == TransferTuning()  # no flags: the transfer layer's own defaults
    assert data_host(cfg) == "10.99.0.2"  # the data plane uses the given address, not the wildcard --host
    assert parse().disaggregation == DisaggregationConfig() and not parse().disaggregation.enabled


def test_refusals() -> None:
    assert parse("--disaggregation-mode", "prefill", "--tp-size", "2").tp_size == 2  # PD with TP is served
    with pytest.raises(SystemExit, match="needs --disaggregation-transfer-backend mooncake"):
        parse("--disaggregation-mode", "prefill", "--tp-size", "2", "--disaggregation-transfer-backend", "local")
    with pytest.raises(SystemExit, match="failure probability"):
        parse("--disaggregation-failure-prob", "2")
    with pytest.raises(SystemExit):
        parse("--disaggregation-mode", "bogus")
    with pytest.raises(SystemExit):
        parse("--disaggregation-layer-groups", "0")
    assert parse("--disaggregation-layer-groups", " AUTO ").disaggregation.layer_groups == "auto"
    assert parse("--disaggregation-layer-groups", "3").disaggregation.layer_groups == 3
    with pytest.raises(ConfigError, match="layer groups"):
        DisaggregationConfig(layer_groups=1.5)
    with pytest.raises(ConfigError, match="TP ranks are separate processes"):
        check_backend(DisaggregationConfig(mode="decode", transfer_backend="local"), tp_size=2)
    assert check_backend(DisaggregationConfig(mode="decode"), tp_size=4).crosses_processes
    with pytest.raises(ConfigError, match="ib-device needs --disaggregation-transfer-backend mooncake"):
        check_backend(DisaggregationConfig(mode="decode", transfer_backend="local", ib_device="mlx5_0"), 1)
    check_backend(DisaggregationConfig(transfer_backend="local"), tp_size=2)  # colocated TP is fine
    check_backend(DisaggregationConfig(mode="decode", transfer_backend="local"), 1)  # tests' in-process PD
    with pytest.raises(ConfigError, match="PD servers need mooncake"):  # but not `kvpipe serve`
        check_backend(DisaggregationConfig(mode="decode", transfer_backend="local"), 1, own_process=True)


def test_unknown_backend_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(SystemExit) as e:  # argparse's choices come from the registry
        parse("--disaggregation-transfer-backend", "nixl")
    assert e.value.code == 2
    for name in ("nixl", ""):
        cfg = DisaggregationConfig(mode="prefill", transfer_backend=name)
        with pytest.raises(ConfigError, match=r"unknown transfer backend .*; known: mooncake, local"):
            check_backend(cfg, 1)
    with pytest.raises(ConfigError, match="known: mooncake, local"):
        open_backend("nixl", BackendOptions())
    bad = ServerConfig("m", disaggregation=DisaggregationConfig(mode="prefill", transfer_backend="nixl"))
    with pytest.raises(ConfigError, match="unknown transfer backend 'nixl'"):
        make_backend(bad)  # no fallback to another backend


def test_help_lists_every_registered_backend(capsys: pytest.CaptureFixture[str]) -> None:
    parser, _ = build_parser(["serve"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    for spec in BACKENDS:
        assert f"{spec.name}: {spec.summary}" in text


def test_parts_validate_themselves() -> None:
    """Transfer tuning and fault injection refuse what DisaggregationConfig refused before the split."""
    for bad in (
        dict(max_inflight_ops=0),
        dict(control_send_hwm=0),
        dict(http_timeout_s=0.0),
        dict(tick_s=0.0),
        dict(max_tick_s=-1.0),
        dict(idle_tick_s=0.0),
    ):
        with pytest.raises(ConfigError):
            TransferTuning(**bad)
    for prob in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="failure probability"):
            FaultInjection(prob=prob)
    for cap in (-1, 1.5):
        with pytest.raises(ConfigError, match="max failures"):
            FaultInjection(prob=0.5, max_failures=cap)  # type: ignore[arg-type]
    assert FaultInjection(prob=1.0).enabled and not FaultInjection().enabled
    for bad in (
        dict(heartbeat_misses=0),
        dict(layer_groups_min_tokens=-1),
        dict(staging_pool_mb=0),
        dict(waiting_timeout_s=0.0),
    ):
        with pytest.raises(ConfigError):
            DisaggregationConfig(**bad)
    with pytest.raises(SystemExit, match="heartbeat_misses"):
        parse("--disaggregation-heartbeat-max-failure", "0")
