"""JIT build and load of the C++ CPU kernels (paged_decode.cpp; EXTRA_KERNELS), once per process.

The extension compiles on the machine that runs it (`-march=native`) into a per-user cache keyed
by torch version, CPU (`-march=native` code must not load on another CPU sharing the home
directory) and sources (their checkout and bytes), ~/.cache/kvpipe/kernels/torch-<version>-<cpu
key>-<sources key> or $KVPIPE_KERNEL_DIR; torch's
cpp_extension rebuilds it when the source or flags change. Builders take an flock on the directory
(`build_lock`), so servers starting together build it once; torch's own `lock` file stays behind
when a builder is killed (and every later build would wait on it forever), so one found while the
flock is held is stale and removed. `make setup` builds it ahead of time (`python -m
kvpipe.model.cpu.kernels`). KVPIPE_CPU_KERNELS=0 turns the kernels off; a failed build (no
compiler, no ninja) logs one warning and every caller falls back to the torch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
EXTENSION_NAME = "kvpipe_paged_decode"
# the other extensions, source stem -> module name: the weight-only quantized linears
# (weight_only.cpp), the RoPE + KV store of the decode step (rope_store.cpp), the one-call
# decoder layer of a decode step (decode_layer.cpp) and the bf16 linears (bf16_panel.cpp), each
# in its own subdirectory of the build
# directory (torch's build files are per directory)
EXTRA_KERNELS = {
    "weight_only": "kvpipe_weight_only",
    "rope_store": "kvpipe_rope_store",
    "decode_layer": "kvpipe_decode_layer",
    "bf16_panel": "kvpipe_bf16_panel",
}
# sources an extension #includes: torch's JIT build rebuilds when the listed source or the flags
# change, so their digest goes into the flags (decode_layer.cpp compiles the other kernels' code)
INCLUDED_SOURCES = {"decode_layer": ("weight_only", "rope_store", "paged_decode", "bf16_panel")}
DISABLE_ENV = "KVPIPE_CPU_KERNELS"
DIR_ENV = "KVPIPE_KERNEL_DIR"
# -fopenmp: at::parallel_for is inline OpenMP in ATen's headers (the .so then shares torch's libgomp)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]


def kernels_enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cpu_key() -> str:
    """Short digest of this CPU's model name and instruction-set flags (Linux /proc/cpuinfo;
    elsewhere the machine name)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        ident = "|".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        ident = ""
    return hashlib.sha256((ident or platform.machine()).encode()).hexdigest()[:12]


@functools.cache
def sources_key() -> str:
    """Short digest of where the kernel sources are and what they hold: two checkouts (or two
    versions) build into directories of their own, so neither keeps rebuilding the other's (torch's
    build files name the sources by path, and ninja rebuilds when a command's path changes)."""
    here = Path(__file__).parent
    h = hashlib.sha256(str(here.resolve()).encode())
    for src in sorted(here.glob("*.cpp")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:12]


def build_dir() -> Path:
    env = os.environ.get(DIR_ENV)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvpipe" / "kernels" / f"torch-{torch.__version__}-{cpu_key()}-{sources_key()}"


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv used without activation has it next to its python only."""
    if shutil.which("ninja") is None:
        import ninja  # the PyPI package ships the binary

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


BUILD_LOCK = ".kvpipe-build.lock"  # our flock, next to torch's FileBaton file `lock`


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold an flock on `directory` while building there: the kernel drops it when its holder
    dies, unlike torch's `lock` file, which a killed build leaves behind (then removed here: no
    build of ours can be running while we hold the flock)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / BUILD_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing a stale build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(
    source: Path | None = None,
    directory: Path | None = None,
    verbose: bool = False,
    name: str = EXTENSION_NAME,
    extra_cflags: tuple[str, ...] = (),
) -> ModuleType:
    """Compile (or reuse) and import the extension; raises when it cannot be built. `name`: another
    module name lets a second build of another source (a baseline to benchmark against) load into
    the same process."""
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    source = source or SOURCE
    directory = directory or build_dir()
    with build_lock(directory):
        return load(
            name=name,
            sources=[str(source)],
            extra_cflags=[*CFLAGS, *extra_cflags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=verbose,
        )


@functools.cache
def load_extension() -> ModuleType | None:
    """The built extension, or None (one warning) when the build fails. Memoised per process."""
    return _load(build)


def build_extra(stem: str) -> ModuleType:
    """Compile (or reuse) and import one of EXTRA_KERNELS."""
    here = Path(__file__).parent
    included = INCLUDED_SOURCES.get(stem, ())
    digest = hashlib.sha256(b"".join((here / f"{s}.cpp").read_bytes() for s in included)).hexdigest()[:16]
    flags = (f"-DKVPIPE_INCLUDED_SOURCES_DIGEST={digest}",) if included else ()
    return build(here / f"{stem}.cpp", build_dir() / stem, name=EXTRA_KERNELS[stem], extra_cflags=flags)


@functools.cache
def load_extra(stem: str) -> ModuleType | None:
    """One of EXTRA_KERNELS, or None (one warning) when its build fails. Memoised per process."""
    return _load(lambda: build_extra(stem))


def _load(make: Callable[[], ModuleType]) -> ModuleType | None:
    try:
        return make()
    except Exception as e:  # no compiler, no ninja, a compile error: the torch path still works
        reason = str(e).strip().splitlines()
        log.warning(
            "CPU kernels unavailable, using the torch path: %s: %s",
            type(e).__name__,
            reason[-1] if reason else "",
        )
        return None
