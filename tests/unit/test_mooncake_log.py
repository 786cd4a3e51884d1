"""Mooncake's start-up lines leave fd 2 for the debug log; everything else written meanwhile
comes back to fd 2 (kvpipe/transfer/backends/mooncake_log.py)."""

from __future__ import annotations

import logging
import os

import pytest

from kvpipe.transfer.backends.mooncake_log import is_start_noise, quiet_start

NOISE = [
    "WARNING: Logging before InitGoogleLogging() is written to STDERR\n",
    "E1202 03:11:49.462404 15248 transfer_metadata.cpp:1098] Local segment descriptor not found\n",
    "W1202 03:11:49.462361 15248 topology.cpp:201] No RDMA devices found, check your device installation\n",
]
REAL = "E1202 03:11:49.500000 15248 transfer_engine.cpp:77] Failed to bind port 1234\n"


def test_known_lines_are_noise_and_others_are_not() -> None:
    assert all(is_start_noise(line) for line in NOISE)
    assert not is_start_noise(REAL)
    assert not is_start_noise("Local segment descriptor not found\n")  # not glog's: someone else's


def test_quiet_start_hands_noise_to_debug_and_keeps_the_rest(capfd: pytest.CaptureFixture[str], caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvpipe.transfer.backends.mooncake_log"):
        with quiet_start({"MC_LOG_LEVEL": "ERROR"}):
            for line in [*NOISE, REAL]:
                os.write(2, line.encode())
    err = capfd.readouterr().err
    assert err == REAL
    assert [r.getMessage() for r in caplog.records] == [f"mooncake: {line.rstrip()}" for line in NOISE]


def test_verbose_mooncake_logging_keeps_everything(capfd: pytest.CaptureFixture[str]) -> None:
    with quiet_start({"MC_LOG_LEVEL": "info"}):
        os.write(2, NOISE[1].encode())
    assert capfd.readouterr().err == NOISE[1]


def test_an_exception_in_the_block_restores_fd2(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError), quiet_start({}):
        os.write(2, REAL.encode())
        raise RuntimeError("initialize failed")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == REAL + "after\n"
