"""`kvpipe bench serve` against a real colocated `kvpipe serve` (tiny preset, 4 short requests),
with `--api chat` too, and the same client reaching a server across the link testbed (root only).
Nothing is timed: the tests check that every request completes with the exact token counts, that
chat prompts are counted as the server rendered them, and that the JSON and PNG outputs are
written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpipe.bench.serve import command as serve
from kvpipe.bench.serve.chat_text import ChatText, open_chat_text
from kvpipe.bench.serve.stacks import Endpoint
from kvpipe.bench.workload import WorkloadConfig, build_workload, parse_lengths
from kvpipe.harness import driver
from kvpipe.harness.latency import summarize
from kvpipe.harness.request import Api
from kvpipe.harness.testbed import LinkTestbed, can_run
from kvpipe.launch.ports import free_port
from kvpipe.launch.process import stop_process, wait_healthy

pytestmark = pytest.mark.timeout(180)


def _serve_cmd(model: Path, host: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvpipe.cli",
        "serve",
        "--model-path",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--max-total-tokens",
        "4096",
        "--log-level",
        "warning",
    ]


def test_bench_serve_smoke(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    port = free_port()
    proc = subprocess.Popen(
        _serve_cmd(tiny_model_dir, "127.0.0.1", port),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url + "/health", 120, [proc])
        out = tmp_path / "run.json"
        rc = serve.main(
            [
                "--url",
                url,
                "--prompt-lens",
                "8,24",
                "--output-lens",
                "3",
                "--num-requests",
                "4",
                "--concurrency",
                "2",
                "--json",
                "--out",
                str(out),
                "--no-progress",
                "--timeline",  # a server, not a router: its own /debug/requests
                str(tmp_path / "timeline.png"),
            ]
        )
    finally:
        stop_process(proc)
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert printed["timeline_plot"] == str(tmp_path / "timeline.png")
    assert printed["timeline_requests"] == 4  # the measured requests, not the warm-up
    assert printed == json.loads(out.read_text())
    s = printed["summary"]
    assert (s["completed"], s["failed"]) == (4, 0)
    assert s["total_output_tokens"] == 12 and s["total_input_tokens"] == 8 + 24 + 8 + 24
    assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] and s["tpot_p50_ms"] > 0 and s["output_throughput"] > 0
    assert printed["workload"]["vocab_size"] == json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    assert (tmp_path / "run.png").stat().st_size > 1000


def _rendered_prompt_tokens(text: ChatText, vocab: int, prompt_lens: str, n: int) -> list[int]:
    """What the server computes for each request of a chat workload: its user text inside the chat
    template, encoded (the server's own encode_chat on the same tokenizer files)."""
    cfg = WorkloadConfig(parse_lengths(prompt_lens), parse_lengths("2"), n, min(vocab, text.vocab_size), api=Api.CHAT)
    return [
        len(text.tokenizer.encode_chat([{"role": "user", "content": str(r.prompt)}]))
        for r in build_workload(cfg, text).requests
    ]


def test_bench_serve_chat_reports_the_rendered_prompt(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--api chat against a real server: the requests go to /v1/chat/completions (uvicorn's access
    log, on at debug level, names each path) and the input tokens are the rendered prompts'."""
    port, log = free_port(), tmp_path / "server.log"
    cmd = _serve_cmd(tiny_model_dir, "127.0.0.1", port)
    cmd[cmd.index("warning")] = "debug"
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url + "/health", 120, [proc])
        flags = ["--prompt-lens", "8,24", "--output-lens", "2", "--num-requests", "2", "--concurrency", "2"]
        rc = serve.main(["--url", url, "--api", "chat", *flags, "--warmup-requests", "0", "--json", "--no-progress"])
    finally:
        stop_process(proc)
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s, vocab = printed["summary"], json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (2, 0, 4)
    rendered = _rendered_prompt_tokens(open_chat_text(tiny_model_dir), vocab, "8,24", 2)
    assert s["total_input_tokens"] == sum(rendered) and rendered[0] > 8 and rendered[1] > 24  # template tokens
    assert printed["workload"]["api"] == "chat"
    posts = [line for line in log.read_text(errors="replace").splitlines() if '"POST /' in line]
    assert len(posts) == 2 and all('"POST /v1/chat/completions HTTP/1.1" 200' in p for p in posts), posts


@pytest.mark.skipif(not can_run(), reason="needs root and iproute2")
def test_client_across_testbed(tiny_model_dir: Path) -> None:
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    wl = build_workload(WorkloadConfig(parse_lengths("16"), parse_lengths("2"), 4, vocab))
    with LinkTestbed("1gbit") as tb:
        port = tb.call_in("a", free_port, tb.addr_a)
        proc = tb.popen(
            "a", _serve_cmd(tiny_model_dir, tb.addr_a, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        ep = Endpoint(f"http://{tb.addr_a}:{port}", netns=tb.ns_b)  # the client sits on side b
        ep.call(wait_healthy, ep.url + "/health", 120, [proc])
        res = ep.call(driver.run, ep.url, wl.requests, 2, 60.0, False)
    assert proc.poll() is not None  # the testbed stopped it
    assert [r.reason for r in res.outcomes] == [""] * 4
    assert summarize(res.outcomes, res.duration_s)["total_output_tokens"] == 8


def test_compare_colocated_smoke(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """PD stack (launch's core split) and a colocated server in one run, the same requests on both."""
    pytest.importorskip("mooncake.engine")
    out = tmp_path / "cmp.json"
    rc = serve.main(
        [
            "--compare-colocated",
            "--prompt-lens",
            "24",
            "--output-lens",
            "3",
            "--num-requests",
            "4",
            "--concurrency",
            "2",
            "--log-dir",
            str(tmp_path / "logs"),
            "--out",
            str(out),
            "--no-progress",
            "--startup-timeout",
            "90",
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "PD / colocated" in table and "colocated (" in table
    res = json.loads(out.read_text())
    assert res["modes"] == ["pd", "inproc"]
    [row] = res["compare"]
    assert row["prompt_len"] == 24
    for side in ("pd", "colocated"):
        assert (row[side]["completed"], row[side]["failed"]) == (4, 0)
    assert all(v is not None and v > 0 for v in row["ratio"].values())
    threads = res["cpu_threads"]
    prefill, decode, colocated = threads["pd"]["prefill"], threads["pd"]["decode"], threads["inproc"]["colocated"]
    assert colocated["source"] == "affinity" and colocated["total"] == res["machine"]["cores"]
    assert prefill["total"] + decode["total"] <= max(2, res["machine"]["cores"])


@pytest.mark.slow  # the /generate sibling (test_compare_colocated_smoke) runs in make test
def test_compare_colocated_chat(tmp_path: Path) -> None:
    """--compare-colocated --api chat: both sides (the PD stack behind its router, and the
    colocated server) answer every chat request, and count the rendered prompts alike."""
    pytest.importorskip("mooncake.engine")
    out = tmp_path / "cmp.json"
    flags = ["--prompt-lens", "24", "--output-lens", "2", "--num-requests", "2", "--concurrency", "2"]
    rc = serve.main(
        [
            "--compare-colocated",
            "--api",
            "chat",
            *flags,
            "--warmup-requests",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
            "--out",
            str(out),
            "--no-progress",
            "--startup-timeout",
            "90",
        ]
    )
    res = json.loads(out.read_text())
    assert rc == 0, res["summaries"]
    text = open_chat_text(res["model_path"])
    vocab = json.loads((Path(res["model_path"]) / "config.json").read_text())["vocab_size"]
    rendered = _rendered_prompt_tokens(text, vocab, "24", 2)
    [row] = res["compare"]
    for side in ("pd", "colocated"):
        assert (row[side]["completed"], row[side]["failed"]) == (2, 0)
        assert row[side]["prompt_tokens_mean"] == sum(rendered) / 2 > 24
