"""scripts/system-deps.sh (run by `make setup`): nothing to do when the libraries are there; as a
non-root user with one missing, a single line naming the apt-get command and a failing exit; no C++
compiler alone (the CPU kernel falls back to torch) is a note."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "system-deps.sh"


def run(
    tmp_path: Path, ldconfig_out: str, uid: int, venv_ok: bool = True, cxx: str = "true"
) -> subprocess.CompletedProcess:
    """The script with fake `ldconfig`, `id`, `ip` and python (with or without ensurepip) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {
        "ldconfig": f"printf '{ldconfig_out}'",
        "id": f"echo {uid}",
        "ip": "true",
        "fakepython": "true" if venv_ok else "exit 1",
    }
    for name, body in fakes.items():
        f = bin_dir / name
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PY": "fakepython", "CXX": cxx}
    return subprocess.run(["sh", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=30)


def test_all_present_does_nothing(tmp_path: Path) -> None:
    libs = "\\tlibibverbs.so.1 => /x\\n\\tlibrdmacm.so.1 => /x\\n\\tlibnuma.so.1 => /x\\n"
    r = run(tmp_path, libs, uid=1000)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""


def test_missing_library_without_root_says_what_to_run(tmp_path: Path) -> None:
    r = run(tmp_path, "\\tlibnuma.so.1 => /x\\n", uid=1000)
    assert r.returncode == 1
    assert r.stderr.strip() == (
        "kvpipe setup: missing libibverbs.so.1 librdmacm.so.1; run: "
        "sudo apt-get install libibverbs1 librdmacm1 libnuma1 iproute2"
    )


def test_a_python_without_ensurepip_gets_python3_venv(tmp_path: Path) -> None:
    libs = "\\tlibibverbs.so.1 => /x\\n\\tlibrdmacm.so.1 => /x\\n\\tlibnuma.so.1 => /x\\n"
    r = run(tmp_path, libs, uid=1000, venv_ok=False)
    assert r.returncode == 1
    assert r.stderr.strip() == (
        "kvpipe setup: missing ensurepip; run: "
        "sudo apt-get install libibverbs1 librdmacm1 libnuma1 iproute2 python3-venv"
    )


def test_no_compiler_alone_is_a_note_not_a_failure(tmp_path: Path) -> None:
    libs = "\\tlibibverbs.so.1 => /x\\n\\tlibrdmacm.so.1 => /x\\n\\tlibnuma.so.1 => /x\\n"
    r = run(tmp_path, libs, uid=1000, cxx="no-such-compiler")
    assert r.returncode == 0 and "sudo apt-get install g++" in r.stderr


def test_no_compiler_joins_a_missing_library(tmp_path: Path) -> None:
    r = run(tmp_path, "\\tlibnuma.so.1 => /x\\n", uid=1000, cxx="no-such-compiler")
    assert r.returncode == 1
    assert r.stderr.strip() == (
        "kvpipe setup: missing libibverbs.so.1 librdmacm.so.1 g++; run: "
        "sudo apt-get install libibverbs1 librdmacm1 libnuma1 iproute2 g++"
    )
