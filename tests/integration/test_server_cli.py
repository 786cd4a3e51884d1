"""The `kvpipe` console script: init-model, generate --json, flag parsing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpipe.cli import build_parser
from kvpipe.commands.flags import server_config_from_args
from tests.helpers.gguf_files import Q, write_gguf

pytestmark = pytest.mark.timeout(300)

KVPIPE = str(Path(sys.executable).parent / "kvpipe")  # the installed console script


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([KVPIPE, *args], capture_output=True, text=True, timeout=timeout)


def test_init_model_then_generate_json(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "ckpt"
    r = _run("init-model", "--preset", "tiny", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == out
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (out / name).is_file(), name

    def gen(model: Path) -> list[dict]:
        g = _run(
            "generate",
            "--model-path",
            str(model),
            "--prompt",
            "Hello there",
            "--prompt",
            "Bye",
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
            "--json",
        )
        assert g.returncode == 0, g.stderr
        return [json.loads(line) for line in g.stdout.splitlines() if line.strip()]

    mine, fixture = gen(out), gen(tiny_model_dir)
    assert [m["prompt"] for m in mine] == ["Hello there", "Bye"]
    for m in mine:
        assert 1 <= len(m["output_ids"]) <= 6 and isinstance(m["text"], str)
        assert m["meta_info"]["completion_tokens"] == len(m["output_ids"])
    # same preset and seed -> same weights -> same greedy tokens
    assert [m["output_ids"] for m in mine] == [f["output_ids"] for f in fixture]


def test_bad_flags_fail_cleanly(tmp_path: Path) -> None:
    r = _run("init-model", "--preset", "huge", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = _run("serve", "--no-such-flag")
    assert r.returncode == 2 and "unrecognized" in r.stderr
    r = _run("generate", "--model-path", str(tmp_path), "--prompt", "x", "--max-new-tokens", "0")
    assert r.returncode != 0 and "max-new-tokens" in r.stderr
    r = _run("--help")
    assert r.returncode == 0 and all(
        c in r.stdout for c in ("serve", "generate", "init-model", "launch", "bench", "testbed")
    )
    r = _run("bench", "--help")
    assert r.returncode == 0 and "serve" in r.stdout and "transfer" in r.stdout


def test_server_config_from_args(tmp_path: Path) -> None:
    parser, runners = build_parser(["serve"])
    assert list(runners) == [("serve",)]  # only the named command's module is loaded
    args = parser.parse_args(
        [
            "serve",
            "--model-path",
            str(tmp_path),
            "--port",
            "1234",
            "--tp-size",
            "2",
            "--page-size",
            "16",
            "--chunked-prefill-size",
            "256",
            "--max-running-requests",
            "8",
            "--max-total-tokens",
            "4096",
            "--context-length",
            "1024",
            "--served-model-name",
            "m",
            "--log-level",
            "warning",
        ]
    )
    cfg = server_config_from_args(args)
    assert (cfg.model_path, cfg.port, cfg.tp_size, cfg.model_name, cfg.log_level) == (
        str(tmp_path),
        1234,
        2,
        "m",
        "warning",
    )
    assert (cfg.cache.page_size, cfg.cache.max_total_tokens, cfg.cache.pages()) == (16, 4096, 256)
    assert (cfg.scheduler.chunked_prefill_size, cfg.scheduler.max_running_requests, cfg.scheduler.context_length) == (
        256,
        8,
        1024,
    )
    with pytest.raises(SystemExit):
        server_config_from_args(parser.parse_args(["serve", "--model-path", "x", "--page-size", "0"]))


def test_python_dash_m_kvpipe_runs_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpipe", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(cmd in out.stdout for cmd in ("serve", "launch", "generate", "init-model", "bench"))


def _bad_gguf(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A GGUF kvpipe must refuse, and a word its error line must hold."""
    path = tmp_path / f"{case}.gguf"
    if case == "truncated":
        blob = write_gguf(path, "llama", Q.Q4_0).path.read_bytes()
        path.write_bytes(blob[: len(blob) * 2 // 3])
        return path, "truncated or corrupt"
    if case == "architecture":
        return write_gguf(path, "llama", arch="gemma2").path, "'gemma2' is not supported"
    return write_gguf(path, "llama", Q.TQ1_0).path, "unsupported tensor types"


BAD_GGUF_CASES = ["truncated", "architecture", "quant type"]
COMMANDS = {"generate": ("--prompt", "x"), "serve": ("--port", "1"), "launch": ("--port", "1")}


@pytest.mark.parametrize(
    "case,command",
    [
        # `make test` pairs each case with one command (each command and each case once); every
        # other pairing is the full sweep (`make test-full`)
        pytest.param(case, cmd, marks=[] if i == j else [pytest.mark.slow])
        for i, case in enumerate(BAD_GGUF_CASES)
        for j, cmd in enumerate(COMMANDS)
    ],
)
def test_bad_gguf_is_one_error_line_from_each_command(tmp_path: Path, case: str, command: str) -> None:
    """serve, generate and launch refuse it before anything starts: exit 1, the reason on one line,
    no traceback (the engine thread would log one)."""
    path, words = _bad_gguf(tmp_path, case)
    r = _run(command, "--model-path", str(path), *COMMANDS[command])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "Traceback" not in r.stderr, (command, r.stderr)
    assert len([line for line in lines if str(path) in line]) == 1 and words in lines[-1], (command, r.stderr)
