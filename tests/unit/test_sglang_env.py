"""SGLang's environment variables as flag defaults (kvpipe/sglang_env.py): a set variable is the
default, a given flag wins, a malformed value is a ConfigError naming the variable, an ignored
one is logged, and the table in docs/flags.md lists exactly the variables and flags of the code's."""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import pytest

from kvpipe.cli import build_parser, main
from kvpipe.commands.flags import add_server_args, server_config_from_args
from kvpipe.config import ConfigError, DisaggregationConfig, FaultInjection
from kvpipe.sglang_env import SGLANG_ENV, LayersPerGroup, flag_defaults, log_sglang_env

FLAGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def parse(*flags: str, model_path: str = "m") -> DisaggregationConfig:
    argv = ["serve", "--model-path", model_path, *flags]
    parser, _ = build_parser(argv)
    return server_config_from_args(parser.parse_args(argv)).disaggregation


@pytest.fixture(autouse=True)
def no_sglang_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in SGLANG_ENV:  # whatever the machine running the tests has set
        monkeypatch.delenv(var.name, raising=False)


def test_variables_are_the_defaults_of_their_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "600",
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2.5",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "4",
        "SGLANG_DISAGG_STAGING_BUFFER": "1",
        "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "16",
        "SGLANG_PIPELINE_MIN_TOKENS": "2048",
        "SGLANG_TEST_DISAGG_FAILURE_PROB": "0.25",
    }.items():
        monkeypatch.setenv(name, value)
    d = parse()
    assert (d.bootstrap_timeout_s, d.waiting_timeout_s, d.heartbeat_interval_s, d.heartbeat_misses) == (
        120,
        600,
        2.5,
        4,
    )
    assert (d.staging, d.staging_pool_nbytes, d.layer_groups_min_tokens) == ("on", 16 << 20, 2048)
    assert d.faults == FaultInjection(prob=0.25)
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "auto")  # kvpipe's own modes are read too
    assert parse().staging == "auto"


def test_a_given_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "600")
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "true")
    monkeypatch.setenv("SGLANG_PIPELINE_GROUP_SIZE", "4")
    d = parse(
        "--disaggregation-waiting-timeout",
        "7",
        "--disaggregation-staging-buffer",
        "off",
        "--disaggregation-layer-groups",
        "auto",
    )
    assert (d.waiting_timeout_s, d.staging, d.layer_groups) == (7, "off", "auto")


def test_pipelining_variables_map_onto_the_layer_groups(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                architectures=["LlamaForCausalLM"],
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=10,
                num_attention_heads=2,
            )
        )
    )
    monkeypatch.setenv("SGLANG_PIPELINE_GROUP_SIZE", "4")  # layers per group: 10 layers -> 3 groups
    assert flag_defaults({"SGLANG_PIPELINE_GROUP_SIZE": "4"}) == {"disaggregation_layer_groups": LayersPerGroup(4)}
    assert parse(model_path=str(tmp_path)).layer_groups == 3
    monkeypatch.setenv("SGLANG_PIPELINE_GROUP_SIZE", "32")  # one group holding every layer: the plain path
    assert parse(model_path=str(tmp_path)).layer_groups == 1
    monkeypatch.setenv("SGLANG_PIPELINE_GROUP_SIZE", "0")  # SGLang: not positive -> the plain path
    assert parse().layer_groups == 1
    monkeypatch.setenv("SGLANG_PIPELINE_GROUP_SIZE", "5")
    with pytest.raises(SystemExit, match="SGLANG_PIPELINE_GROUP_SIZE.*no config.json"):
        parse(model_path=str(tmp_path / "missing"))
    monkeypatch.setenv("SGLANG_ENABLE_PIPELINED_KV_TRANSFER", "0")  # switched off wins over the size
    assert parse().layer_groups == 1
    monkeypatch.delenv("SGLANG_PIPELINE_GROUP_SIZE")
    monkeypatch.setenv("SGLANG_ENABLE_PIPELINED_KV_TRANSFER", "1")  # on: kvpipe's default stays
    assert parse().layer_groups == "auto"
    monkeypatch.setenv("SGLANG_PIPELINED_KV_TRANSFER", "no")  # the earlier PR's name for the switch
    monkeypatch.delenv("SGLANG_ENABLE_PIPELINED_KV_TRANSFER")
    assert parse().layer_groups == 1


@pytest.mark.parametrize(
    "name, value",
    [
        ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "soon"),
        ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "0"),
        ("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "nan"),
        ("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "0"),
        ("SGLANG_DISAGG_STAGING_BUFFER", "maybe"),
        ("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "1.5"),
        ("SGLANG_ENABLE_PIPELINED_KV_TRANSFER", "2"),
        ("SGLANG_PIPELINE_GROUP_SIZE", "four"),
        ("SGLANG_PIPELINE_MIN_TOKENS", "-1"),
        ("SGLANG_TEST_DISAGG_FAILURE_PROB", "1.5"),
    ],
)
def test_a_malformed_value_names_its_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}="):
        flag_defaults({name: value})
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match=rf"kvpipe: {name}="):  # the CLI: an error line, no traceback
        main(["serve", "--model-path", "m"])


def test_set_variables_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    env = {"SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": "8", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60", "HOME": "/"}
    assert flag_defaults({"SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": "8"}) == {}  # ignored: no default
    with caplog.at_level(logging.INFO):
        log_sglang_env(env, logging.getLogger("test"))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(lines) == 2
    assert lines[0][0] == logging.INFO and "--disaggregation-waiting-timeout" in lines[0][1]
    assert lines[1][0] == logging.WARNING
    assert lines[1][1].startswith("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE is set but ignored: ")


def test_every_flag_of_the_table_exists() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    flags = set(parser._option_string_actions)  # every flag, the help-suppressed test knobs too
    assert {var.flag for var in SGLANG_ENV if var.flag} <= flags


def test_the_docs_table_is_the_codes() -> None:
    rows = re.findall(r"^\| `(SGLANG_\w+)` \| (`--[\w-]+`|—) \|", FLAGS_DOC.read_text(), re.M)
    documented = [(name, None if flag == "—" else flag.strip("`")) for name, flag in rows]
    code = [(var.name, var.flag) for var in SGLANG_ENV]
    assert sorted(documented) == sorted(code)
    assert len({name for name, _ in code}) == len(code)  # no variable twice
