"""The C++ kernels' build lock: a build killed mid-way must not leave every later build waiting."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

from kvpipe.model.cpu.kernels.loader import BUILD_LOCK, build_lock

# a builder that takes the flock, makes torch's lock file as a live build does, and waits
HOLDER = """
import sys, time
from pathlib import Path
from kvpipe.model.cpu.kernels.loader import build_lock
with build_lock(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").touch()
    print("building", flush=True)
    time.sleep(120)
"""


def test_a_stale_torch_lock_is_removed_under_the_flock(tmp_path: Path) -> None:
    stale = tmp_path / "lock"  # what torch's FileBaton leaves when its builder is killed
    stale.touch()
    with build_lock(tmp_path):
        assert not stale.exists()
    assert (tmp_path / BUILD_LOCK).exists()


def test_a_live_builder_keeps_its_lock_and_a_killed_one_frees_it(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "building"
        # the flock is held: another builder would wait, not delete the live build's lock
        with open(tmp_path / BUILD_LOCK, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the live builder's flock was not held")
            except BlockingIOError:
                pass
        assert (tmp_path / "lock").exists()
        holder.kill()  # killed mid-build: the kernel drops its flock, torch's lock file stays
        holder.wait(30)
        assert (tmp_path / "lock").exists()
        with build_lock(tmp_path):  # taken at once (a blocking flock), and the stale lock is gone
            assert not (tmp_path / "lock").exists()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)
