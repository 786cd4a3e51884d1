"""PD lifecycle through sglang-router with short deadlines: malformed control messages, client
disconnects, a decode killed mid-transfer, a prefill killed and restarted on the same ports (with
injected transfer failures from then on). After each: no leaked pages on either side, and the
stack serves again without restarting the survivor. One stack for the module; tests run in order."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.auth import Authenticator
from kvpipe.transfer.control.bootstrap import BootstrapError, fetch_prefill_info, register_prefill_rank
from tests.helpers.pd_stack import Stack, disagg_stats, generate, greedy, pd_body, start_stack, wait_for
from tests.helpers.server import ServerProc

pytest.importorskip("mooncake.engine")

HEARTBEAT_S = 0.5  # a peer silent for 5 beats (2.5 s) is dead
BOOTSTRAP_S, TRANSFER_S = 5.0, 3.0
FLAGS = [
    "--page-size",
    "16",
    "--max-total-tokens",
    "32768",
    "--chunked-prefill-size",
    "128",
    "--disaggregation-heartbeat-interval",
    str(HEARTBEAT_S),
    "--disaggregation-bootstrap-timeout",
    str(BOOTSTRAP_S),
    "--disaggregation-waiting-timeout",
    "20",
    "--disaggregation-transfer-timeout",
    str(TRANSFER_S),
]
DEADLINE_S = 5 * HEARTBEAT_S + TRANSFER_S + 10.0  # detection + drain + slack for a loaded host
LONG = [(i * 7919) % 280 + 3 for i in range(7000)]  # 55 chunks of 128: a long prefill to interrupt


def uncached_long(first: int) -> list[int]:
    """LONG under a first token no other prompt here starts with (LONG's are 3..282): the prefill's
    prefix cache holds LONG from earlier tests, and a cached prompt ends before a test can catch
    the prefill computing it."""
    return [first, *LONG[1:]]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("pd-lifecycle"), *FLAGS)
    try:
        yield s
    finally:
        s.close()


def short(stack: Stack, n: int = 30, new: int = 4) -> dict:
    return generate(stack.router, {"input_ids": LONG[:n], "sampling_params": greedy(new)})


def idle(*servers: ServerProc, timeout_s: float = DEADLINE_S) -> None:
    for srv in servers:
        srv.wait_idle(timeout_s)


def kill(srv: ServerProc) -> None:
    os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)


def serves_again(stack: Stack, timeout_s: float = 60.0) -> dict:
    """The router may need a few health checks to trust a restarted worker again."""

    def attempt() -> dict | None:
        try:
            out = short(stack)
        except (AssertionError, httpx.HTTPError):
            return None
        return out if out["meta_info"]["finish_reason"]["type"] == "length" else None

    return wait_for(attempt, timeout_s, "a successful request through the router", interval_s=0.5)


def test_forged_and_malformed_control_messages_are_rejected(stack: Stack) -> None:
    """The stack runs with launch's auth token: frames without its tag (garbage, unsigned or
    wrongly signed messages, a replay) are dropped before decoding; messages signed with it reach
    validation, which refuses the bogus ones. Both servers keep serving, unchanged."""
    ref = short(stack)["output_ids"]
    assert stack.pd.auth_token and all(disagg_stats(s)["authenticated"] for s in (stack.prefill, stack.decode))
    junk = [
        b"",
        b"\x00garbage\xff",
        os.urandom(257),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"kind": "transfer_request", "version": 1}),  # fields missing
        msgpack.packb({"kind": "transfer_request", "version": 99, "room": 1}),
        msgpack.packb({"kind": "no_such_message", "version": 1}),
    ]
    typed = [
        m.TransferRequest(room=7, session_id="intruder/0", dst_pages=(10**9,), prefix_len=0, aux_slot=0),
        m.TransferStatus(room=7, session_id="intruder/0", state=m.WireState.SUCCESS, aux=m.AuxData(7, 1, 0.0)),
        m.Abort(room=7, session_id="intruder/0", side=m.Side.PREFILL, reason="x"),
    ]
    insider, outsider = Authenticator.from_token(stack.pd.auth_token), Authenticator.from_token("not-the-stack-token")
    ctx = zmq.Context()
    try:
        for srv in (stack.prefill, stack.decode):
            st = disagg_stats(srv)
            addr = st["control_address"]
            signed = [insider.seal(m.encode(x), addr.encode()) for x in typed]
            forged = junk + [m.encode(x) for x in typed] + [outsider.seal(m.encode(x), addr.encode()) for x in typed]
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(addr)
            for frame in forged + signed + signed[:1]:  # the last one a replay
                sock.send(frame)
            sock.close()
            dropped = st["auth_rejected"]["control"] + len(forged) + 1
            wait_for(
                lambda srv=srv, dropped=dropped: disagg_stats(srv)["auth_rejected"]["control"] >= dropped,
                10,
                "the forged frames to be dropped",
            )
            # a decode's frame limits (what a decode receives) refuse the TransferRequest as malformed
            # before its book sees it; the other signed ones reach the books, which refuse them
            rejected = st["rejected_messages"] + len(typed) - (st["mode"] == "decode")
            wait_for(
                lambda srv=srv, rejected=rejected: disagg_stats(srv)["rejected_messages"] >= rejected,
                10,
                "the signed bogus messages to be rejected",
            )
            assert srv.metric("kvpipe_pd_auth_rejected_total", 'plane="control"') >= len(forged) + 1
            assert srv.alive()
    finally:
        ctx.term()
    assert short(stack)["output_ids"] == ref


def test_forged_bootstrap_calls_are_rejected(stack: Stack) -> None:
    """Nobody without the token can re-point decodes at their own control endpoint (a forged
    registration) or read the prefill's KV buffer addresses (a look-up)."""
    host, port = "127.0.0.1", stack.pd.bootstrap_port
    insider = Authenticator.from_token(stack.pd.auth_token)
    real = fetch_prefill_info(host, port, auth=insider)
    forged = dataclasses.replace(real.ranks[0], instance_id="attacker", control_address="tcp://127.0.0.1:1")
    before = disagg_stats(stack.prefill)["auth_rejected"]["bootstrap"]
    for auth in (None, Authenticator.from_token("not-the-stack-token")):
        with pytest.raises(BootstrapError, match="401"):
            register_prefill_rank(host, port, forged, auth=auth)
        with pytest.raises(BootstrapError, match="401"):
            fetch_prefill_info(host, port, auth=auth)
    assert disagg_stats(stack.prefill)["auth_rejected"]["bootstrap"] == before + 4
    assert fetch_prefill_info(host, port, auth=insider).instance_id == real.instance_id
    assert short(stack)["meta_info"]["finish_reason"]["type"] == "length"


def test_client_disconnects_leave_no_pages(stack: Stack) -> None:
    # Through the router: a stream dropped after its first event.
    body = {"input_ids": LONG[:500], "sampling_params": greedy(5000), "stream": True}
    with httpx.stream("POST", stack.router + "/generate", json=body, timeout=60) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
    # Non-streaming, the client gives up while the prefill computes.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.router + "/generate", json={"input_ids": LONG, "sampling_params": greedy(8)}, timeout=0.5)
    # A decode waiting for a prefill request that never comes; a prefill whose decode never asks.
    for srv in (stack.decode, stack.prefill):
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                srv.url + "/generate",
                json=pd_body(stack, {"input_ids": LONG[:300], "sampling_params": greedy(8)}),
                timeout=0.5,
            )
        srv.wait_idle(DEADLINE_S)
        assert time.monotonic() - t0 < DEADLINE_S
    idle(stack.prefill, stack.decode)
    assert short(stack)["meta_info"]["finish_reason"]["type"] == "length"


def _in_background(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_decode_killed_mid_transfer(stack: Stack) -> None:
    p, d = stack.prefill, stack.decode
    sent = disagg_stats(p)["bytes_written"]
    # Straight to both servers, as the router sends it (the router would retry with new rooms).
    body = pd_body(stack, {"input_ids": uncached_long(1), "sampling_params": greedy(8)})
    t, box = _in_background(lambda: httpx.post(p.url + "/generate", json=body, timeout=120))
    _in_background(lambda: httpx.post(d.url + "/generate", json=body, timeout=120))
    # KV of the first chunks landed on the decode and the prefill is still computing the rest.
    at_kill = wait_for(
        lambda: (s := p.engine_stats())["disaggregation"]["bytes_written"] > sent and s["num_running"] >= 1 and s,
        60,
        "the transfer to start",
        interval_s=0.02,
    )
    kill(d)
    t0 = time.monotonic()
    assert at_kill["used_pages"] > 0
    p.wait_idle(DEADLINE_S)  # its room failed (dead decode), the prefill stopped and freed the pages
    assert time.monotonic() - t0 < DEADLINE_S
    assert disagg_stats(p)["rooms_failed"] >= 1 and p.alive()
    t.join(30)
    assert box["out"].status_code == 500 and "failed" in box["out"].json()["error"]["message"]
    stack.restart("decode")
    serves_again(stack)
    idle(stack.prefill, stack.decode)


def test_prefill_killed_then_restarted(stack: Stack) -> None:
    p, d = stack.prefill, stack.decode
    body = pd_body(stack, {"input_ids": uncached_long(2), "sampling_params": greedy(8)})  # what the router sends
    t, box = _in_background(lambda: generate(d.url, body))
    bt, box_p = _in_background(lambda: httpx.post(p.url + "/generate", json=body, timeout=120))
    seen: dict = {}

    def both_busy() -> bool:
        seen.update(decode=disagg_stats(d), prefill=p.engine_stats(), prefill_answer=box_p.get("out"))
        return seen["decode"]["active_rooms"] >= 1 and seen["prefill"]["num_running"] >= 1

    try:
        wait_for(both_busy, 60, "the decode to wait for a prefill that is computing", interval_s=0.02)
    except AssertionError as e:  # say what each side was doing
        raise AssertionError(f"{e}: {seen}") from None
    kill(p)
    t0 = time.monotonic()
    t.join(DEADLINE_S + 5)
    assert not t.is_alive(), "the decode kept waiting for a dead prefill"
    assert time.monotonic() - t0 < DEADLINE_S
    out = box["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort", out
    assert "prefill" in out["meta_info"]["finish_reason"]["message"]
    # While no prefill runs, a new request fails after the bootstrap timeout, not later.
    t0 = time.monotonic()
    out = generate(d.url, pd_body(stack, {"input_ids": LONG[:40], "sampling_params": greedy(4)}))
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and "bootstrap" in str(out["meta_info"])
    assert time.monotonic() - t0 < BOOTSTRAP_S + 10
    d.wait_idle(10)
    bt.join(10)
    # A prefill back on the same ports (now failing some transfer batches on purpose) is picked up
    # by the running decode; failures end cleanly on both sides.
    stack.restart("prefill", "--disaggregation-failure-prob", "0.2", "--disaggregation-failure-seed", "1")
    serves_again(stack)

    def one(n: int) -> tuple[str, str]:
        r = httpx.post(
            stack.router + "/generate", json={"input_ids": LONG[:n], "sampling_params": greedy(6)}, timeout=120
        )
        if r.status_code == 200:  # the decode's answer (it may carry an abort of its own)
            fin = r.json()["meta_info"]["finish_reason"]
            return fin["type"], str(fin.get("message"))
        return f"http {r.status_code}", r.text  # the router passes the prefill's error through

    failed_before = disagg_stats(stack.prefill)["rooms_failed"], disagg_stats(stack.decode)["rooms_failed"]
    # The router retries a failed prefill with a new room (and opens its circuit breaker after a
    # run of failures), so the client mostly sees successes; the servers count the failures.
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(one, [30, 300] * 8))
    for kind, msg in outs:
        assert kind in ("length", "abort", "http 500"), (kind, msg)
        if kind != "length":
            assert "KV transfer failed" in msg, msg
    assert sum(k == "length" for k, _ in outs) >= len(outs) // 2, outs
    idle(stack.prefill, stack.decode)
    assert disagg_stats(stack.prefill)["rooms_failed"] > failed_before[0]  # injected failures happened,
    assert disagg_stats(stack.decode)["rooms_failed"] > failed_before[1]  # reached the decode, leaked nothing
