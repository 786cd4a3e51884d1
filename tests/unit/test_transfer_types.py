"""kvpipe.transfer.api: KVSender and KVReceiver match the engine-facing Protocols member by member
(names, parameter names, kinds, defaults and annotations), and importing the package stays light."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import kvpipe.transfer
from kvpipe.config import DisaggregationConfig
from kvpipe.transfer import api as types
from kvpipe.transfer import lifecycle as state
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric
from kvpipe.transfer.control.messages import DecodeRank
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.receiver import kv_receiver as receiver
from kvpipe.transfer.receiver.kv_receiver import KVReceiver
from kvpipe.transfer.sender import kv_sender as sender
from kvpipe.transfer.sender.kv_sender import KVSender

LAYOUT = KVLayout(1, 4, 1, 0, 1, 8, "float32", 4, (1 << 30, 1 << 31), 4 * 4 * 8 * 4)


def protocol_members(proto: type) -> dict[str, typing.Any]:
    return {k: v for k, v in vars(proto).items() if not k.startswith("_")}


def mismatches(proto: type, cls: type, instance: object) -> list[str]:
    """Why `cls` (and an unstarted `instance` of it, for attributes set in __init__) does not
    satisfy `proto`; empty when it does."""
    out = []
    for name, want in protocol_members(proto).items():
        have = inspect.getattr_static(cls, name, None)
        if isinstance(want, property):
            want_type = typing.get_type_hints(want.fget)["return"]
            if isinstance(have, property):
                got = typing.get_type_hints(have.fget).get("return")
                if got != want_type:
                    out.append(f"{name}: property of type {got}, expected {want_type}")
            elif have is not None or not isinstance(getattr(instance, name, None), want_type):
                out.append(f"{name}: expected a {want_type.__name__} property or attribute")
        elif not inspect.isfunction(have):
            out.append(f"{name}: missing method")
        else:
            out += [f"{name}: {why}" for why in signature_mismatches(want, have)]
    return out


def signature_mismatches(want: typing.Callable, have: typing.Callable) -> list[str]:
    wp = list(inspect.signature(want).parameters.values())
    hp = list(inspect.signature(have).parameters.values())
    out = []
    if [(p.name, p.kind) for p in wp] != [(p.name, p.kind) for p in hp[: len(wp)]]:
        out.append(f"parameters {[p.name for p in hp]}, expected {[p.name for p in wp]}")
    out += [
        f"extra required parameter {p.name}"
        for p in hp[len(wp) :]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    out += [f"{w.name} needs a default" for w, h in zip(wp, hp) if w.default is not w.empty and h.default is h.empty]
    want_hints, have_hints = typing.get_type_hints(want), typing.get_type_hints(have)
    out += [f"{k}: {have_hints.get(k)} instead of {v}" for k, v in want_hints.items() if have_hints.get(k) != v]
    return out


@pytest.fixture
def kv_sender():
    s = KVSender(
        DisaggregationConfig(), layout=LAYOUT, backend=LocalBackend(LocalFabric()), model_name="m", instance_id="p"
    )
    yield s
    s.close()


@pytest.fixture
def kv_receiver():
    r = KVReceiver(DisaggregationConfig(), ranks=[DecodeRank(LAYOUT, "local:d")], model_name="m")
    yield r
    r.close()


def test_kv_sender_satisfies_kv_sender_api(kv_sender):
    assert mismatches(types.KVSenderAPI, KVSender, kv_sender) == []
    assert set(protocol_members(types.KVSenderAPI)) >= {
        "add_room",
        "send",
        "abort",
        "poll",
        "take_timings",
        "room_state",
        "num_active_rooms",
        "stats",
        "control_address",
        "instance_id",
        "close",
    }


def test_kv_receiver_satisfies_kv_receiver_api(kv_receiver):
    assert mismatches(types.KVReceiverAPI, KVReceiver, kv_receiver) == []
    assert set(protocol_members(types.KVReceiverAPI)) >= {
        "add_room",
        "abort",
        "poll",
        "room_state",
        "num_active_rooms",
        "stats",
        "control_address",
        "tp_size",
        "close",
    }


def test_the_check_sees_a_drifted_implementation(kv_receiver):
    class Drifted(KVReceiver):
        tp_size = "two"  # type: ignore[assignment]

        def poll(self, timeout: float) -> list:  # type: ignore[override]
            return []

        def abort(self, room: int, reason: str) -> None:  # lost its default
            pass

    problems = mismatches(types.KVReceiverAPI, Drifted, kv_receiver)
    assert any(p.startswith("poll: extra required parameter timeout") for p in problems)
    assert any(p.startswith("poll: return") for p in problems)
    assert "abort: reason needs a default" in problems
    assert any(p.startswith("tp_size:") for p in problems)
    wrong_side = mismatches(types.KVSenderAPI, KVReceiver, kv_receiver)
    assert {p.split(":")[0] for p in wrong_side} == {"stats", "add_room", "send", "poll", "take_timings"}
    assert "send: missing method" in wrong_side


def test_package_reexports_the_plain_types():
    assert kvpipe.transfer.TransferState is state.TransferState
    assert kvpipe.transfer.DuplicateRoomError is state.DuplicateRoomError
    assert kvpipe.transfer.DecodeRank is receiver.DecodeRank
    assert kvpipe.transfer.SenderStats is sender.SenderStats and kvpipe.transfer.TransferTiming is sender.TransferTiming
    assert kvpipe.transfer.ReceiverStats is receiver.ReceiverStats
    assert set(kvpipe.transfer.__all__) == set(types.__all__)


def test_importing_the_package_stays_light():
    code = (
        "import sys, kvpipe.transfer, kvpipe.transfer.api\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('zmq', 'mooncake', 'httpx', 'fastapi', 'uvicorn', 'torch')))"
    )
    root = str(Path(kvpipe.__file__).parents[1])  # this checkout's kvpipe, not an installed one
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": root}
    )
    assert out.stdout.strip() == "[]"
