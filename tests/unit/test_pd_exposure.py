"""Finding 6 and 8 of the second security pass, at the flag level: PD without a token is refused
on a non-loopback data plane unless --disaggregation-insecure says so; the token comes from a
file; `kvpipe launch` takes a token flag off the command lines; the allow list's flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.cli import build_parser
from kvpipe.commands.flags import server_config_from_args
from kvpipe.config import ConfigError, ServerConfig
from kvpipe.disagg.setup import is_loopback, require_auth_off_loopback
from kvpipe.launch.router import router_command
from kvpipe.launch.secret_flags import API_KEY_FLAG, take_secret_flag
from kvpipe.transfer.control.auth import TOKEN_ENV

TOKEN = "a-token-long-enough-to-pass"


def parse(*flags: str) -> ServerConfig:
    argv = ["serve", "--model-path", "m", *flags]
    parser, _ = build_parser(argv)
    return server_config_from_args(parser.parse_args(argv))


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def test_no_token_is_refused_off_loopback_unless_insecure() -> None:
    for host in ("10.255.255.1", "192.0.2.7", "2001:db8::1"):
        cfg = parse("--disaggregation-mode", "decode", "--disaggregation-host", host)
        with pytest.raises(ConfigError, match="--disaggregation-insecure") as e:
            require_auth_off_loopback(cfg)
        assert host in str(e.value) and "--disaggregation-auth-token-file" in str(e.value)
        require_auth_off_loopback(
            parse("--disaggregation-mode", "decode", "--disaggregation-host", host, "--disaggregation-insecure")
        )
        require_auth_off_loopback(
            parse(
                "--disaggregation-mode", "prefill", "--disaggregation-host", host, "--disaggregation-auth-token", TOKEN
            )
        )
    for host in ("127.0.0.1", "127.3.0.1", "::1", "localhost"):
        require_auth_off_loopback(parse("--disaggregation-mode", "prefill", "--disaggregation-host", host))
    require_auth_off_loopback(parse("--host", "0.0.0.0"))  # colocated: no PD plane at all
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("10.0.0.1")


def test_the_token_comes_from_a_file_and_not_twice(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    cfg = parse("--disaggregation-mode", "decode", "--disaggregation-auth-token-file", str(f))
    assert cfg.disaggregation.auth_token == TOKEN
    with pytest.raises(SystemExit, match="not both"):
        parse("--disaggregation-auth-token-file", str(f), "--disaggregation-auth-token", TOKEN)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="is empty"):
        parse("--disaggregation-auth-token-file", str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="auth-token-file"):
        parse("--disaggregation-auth-token-file", str(tmp_path / "missing"))
    (tmp_path / "short").write_text("short\n")
    with pytest.raises(SystemExit, match="16 characters"):
        parse("--disaggregation-auth-token-file", str(tmp_path / "short"))


def test_launch_takes_the_token_flag_off_the_command_line() -> None:
    args = ["--page-size", "16", "--disaggregation-auth-token", TOKEN, "--log-level", "info"]
    assert take_secret_flag(args) == (["--page-size", "16", "--log-level", "info"], TOKEN)
    assert take_secret_flag([f"--disaggregation-auth-token={TOKEN}", "-x"]) == (["-x"], TOKEN)
    assert take_secret_flag(["--disaggregation-auth-token-file", "/f"]) == (
        ["--disaggregation-auth-token-file", "/f"],
        None,
    )


def test_launch_passes_the_api_key_to_the_servers_environment_and_the_router() -> None:
    """The servers read --api-key from KVPIPE_API_KEY (off their command lines); so does the
    router's wrapper (launch/router_main.py), which hands it to sglang-router in-process."""
    assert take_secret_flag(["--api-key", "k1", "--page-size", "16"], API_KEY_FLAG) == (["--page-size", "16"], "k1")
    assert take_secret_flag(["--api-key=k2"], API_KEY_FLAG) == ([], "k2")
    cmd = router_command("http://p", 1, "http://d", "127.0.0.1", 2, 3)
    assert cmd[1:3] == ["-m", "kvpipe.launch.router_main"] and "--api-key" not in cmd


def test_the_allow_list_flag_repeats_and_splits_on_commas() -> None:
    cfg = parse(
        "--disaggregation-mode",
        "decode",
        "--disaggregation-bootstrap-allow",
        "10.0.0.0/8, prefill-0.internal",
        "--disaggregation-bootstrap-allow",
        "::1",
    )
    assert cfg.disaggregation.bootstrap_allow == ("10.0.0.0/8", "prefill-0.internal", "::1")
    assert parse().disaggregation.bootstrap_allow == ()
    with pytest.raises(SystemExit, match="bootstrap-allow"):
        parse("--disaggregation-bootstrap-allow", "10.0.0.0/99")
