"""Emulated link: namespaces appear, carry the address, and are always removed (root only)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from kvpipe.bench.transfer_link import EmulatedLink

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="needs root, ip and tc")]


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_link_up_and_cleaned_up_even_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedLink("100mbit") as link:
            assert link.ns_a in namespaces() and link.ns_b in namespaces()
            if shutil.which("ping"):
                ping = subprocess.run(["ip", "netns", "exec", link.ns_a, "ping", "-c", "1", "-W", "2", link.addr_b],
                                      capture_output=True, text=True, timeout=10)
                assert ping.returncode == 0, ping.stdout + ping.stderr
            qdisc = subprocess.run(["ip", "netns", "exec", link.ns_b, "tc", "qdisc", "show"],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            raise RuntimeError("boom")
    assert link.ns_a not in namespaces() and link.ns_b not in namespaces()


def test_bad_rate_rejected():
    with pytest.raises(ValueError):
        EmulatedLink("fast")
