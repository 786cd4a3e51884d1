"""kvpipe.launch.router_main: sglang-router's keys from files into the arguments it parses (never
into the process's command line), refusals of bad or doubled keys, and sglang-router's own parser
taking the result."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.config import ConfigError
from kvpipe.launch.router_main import router_argv
from kvpipe.server.client_keys import ADMIN_API_KEY_ENV, API_KEY_ENV


def write(tmp: Path, name: str, text: str) -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


def test_keys_from_files_join_the_router_arguments(tmp_path: Path) -> None:
    key = write(tmp_path, "key", "# the router's key\nk-123\n")
    cp = write(tmp_path, "cp", "ops:operators:admin:s1\n\nro:readers:user:s2\n")
    argv = router_argv(["--api-key-file", key, "--control-plane-api-keys-file", cp, "--", "--pd-disaggregation"])
    assert argv == [
        "--pd-disaggregation",
        "--api-key",
        "k-123",
        "--control-plane-api-keys",
        "ops:operators:admin:s1",
        "ro:readers:user:s2",
    ]
    pytest.importorskip("sglang_router")
    from sglang_router.launch_router import parse_router_args

    parsed = parse_router_args(
        [*argv, "--prefill", "http://10.0.0.1:30000", "8998", "--decode", "http://10.0.0.2:30000"]
    )
    assert parsed.api_key == "k-123" and parsed.pd_disaggregation


def test_router_flags_pass_through_without_files() -> None:
    assert router_argv(["--", "--port", "8000"]) == ["--port", "8000"]
    assert router_argv(["--port", "8000"]) == ["--port", "8000"]


@pytest.mark.parametrize(
    ("files", "extra", "match"),
    [
        ({"key": ""}, [], "holds no key"),
        ({"key": "k"}, ["--api-key", "x"], "not both"),
        ({"cp": "no-colons"}, [], "id:name:role:key"),
    ],
)
def test_bad_or_doubled_keys_are_refused(tmp_path: Path, files: dict[str, str], extra: list[str], match: str) -> None:
    argv = []
    for name, text in files.items():
        flag = "--api-key-file" if name == "key" else "--control-plane-api-keys-file"
        argv += [flag, write(tmp_path, name, text)]
    with pytest.raises(ConfigError, match=match):
        router_argv([*argv, "--", *extra])
    with pytest.raises(ConfigError, match="No such file"):
        router_argv(["--api-key-file", str(tmp_path / "missing")])


def test_the_environment_fills_only_the_keys_no_file_gave(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("from-file\n")
    env = {API_KEY_ENV: "from-env", ADMIN_API_KEY_ENV: "adm"}
    out = router_argv(["--api-key-file", str(key), "--", "--port", "1"], env)
    assert out[out.index("--api-key") + 1] == "from-file" and out.count("--api-key") == 1
    assert out[out.index("--control-plane-api-keys") + 1] == "kvpipe-admin:kvpipe admin:admin:adm"
    assert router_argv(["--port", "1"], {}) == ["--port", "1"]


def test_recovery_flags_bound_the_time_to_serve_after_a_heal() -> None:
    """sglang-router parses launch's recovery flags, and with them a worker that answers again is
    routed to within 10 s (issue 50): a health check already in flight may run its timeout, the next
    comes an interval later and one success re-admits it; an open circuit half-opens after its
    timeout and one success closes it. The README's command by hand carries the same flags."""
    pytest.importorskip("sglang_router")
    from sglang_router.launch_router import parse_router_args

    from kvpipe.launch.router import ROUTER_RECOVERY_FLAGS, router_command_xpyd

    cmd = router_command_xpyd([("http://p:30000", 8998)], ["http://d:30000"], "127.0.0.1", 8000, 29000)
    a = parse_router_args(cmd[cmd.index("--pd-disaggregation") :])
    health_s = a.health_check_timeout_secs + a.health_check_interval_secs * a.health_success_threshold
    assert health_s + a.cb_timeout_duration_secs * (a.cb_success_threshold > 1) <= 10
    assert a.cb_timeout_duration_secs <= 10 and a.cb_success_threshold == 1
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert " ".join(ROUTER_RECOVERY_FLAGS[:6]) in readme and " ".join(ROUTER_RECOVERY_FLAGS[6:]) in readme
