"""llama.cpp on the same GGUF: the baseline `kvpipe bench engine --compare-llamacpp` reports its
ratios against (the `llamacpp` extra installs `llama-cpp-python`: `.venv/bin/pip install -e '.[llamacpp]'`).

Run the way a user of `llama_cpp.Llama` would, with kvpipe's thread count for both its batch and
its single-token threads:
- prefill: `reset()` then `eval(prompt)` (n_batch = n_ubatch = the prompt, so one decode call);
- decode: the context is evaluated once (untimed), then each step `eval([token])` with the
  greedy token of the previous step's logits, timed step by step. Batch 1 only: the high-level
  API runs one sequence.

Other storage types of the same weights come from llama.cpp's own quantizer
(`llama_model_quantize`, exposed by the binding) with requantizing allowed: F32 from a Q4_1 file
is its dequantized weights (what kvpipe's fp32 engine computes with), Q8_0 and Q4_1 from that
F32 are what `llama-quantize` would write. `LLAMACPP_PEERS` pairs each --quantization with the
type it is measured against.
"""

from __future__ import annotations

import ctypes
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from kvpipe.bench.engine.stats import DecodePoint, PrefillPoint

# --quantization (None: the model dtype, fp32 on CPU) -> the llama.cpp type of the same weights
LLAMACPP_PEERS = {None: "F32", "w8a16": "Q8_0", "w4a16": "Q4_1"}
# llama_ftype of each type --llamacpp-types takes (llama.h)
FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "kvpipe bench engine: --compare-llamacpp needs llama-cpp-python (pip install -e '.[llamacpp]')"
        ) from None
    return llama_cpp


def convert_gguf(src: Path, dst: Path, kind: str, threads: int) -> Path:
    """`src` rewritten with every tensor llama.cpp quantizes as `kind` (llama_model_quantize with
    requantizing allowed), unless `dst` exists already."""
    if dst.is_file():
        return dst
    lc = _llama_cpp()
    params = lc.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = threads
    params.allow_requantize = True
    tmp = dst.with_suffix(".partial")
    with _quiet(lc):  # llama.cpp logs a line per tensor
        rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src.name} -> {kind} failed ({rc})")
    tmp.rename(dst)
    return dst


def _quiet(lc: Any) -> AbstractContextManager[Any]:
    """llama-cpp-python's own redirect of the C library's stdout/stderr (what Llama(verbose=False)
    uses), where this version has it."""
    suppress = getattr(getattr(lc, "_utils", None), "suppress_stdout_stderr", None)
    return suppress(disable=False) if suppress is not None else nullcontext()


def gguf_type(path: Path) -> str:
    """The file's llama_ftype name as FTYPES spells it (e.g. Q4_1), from its general.file_type."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("general.file_type")
    ftype = int(field.parts[-1][0]) if field is not None else -1
    return next((k for k, v in FTYPES.items() if v == ftype), f"ftype {ftype}")


class LlamaCppReference:
    """One llama.cpp model (a GGUF of type `kind`) and a prompt RNG."""

    def __init__(self, gguf: Path, kind: str, seed: int, threads: int, n_ctx: int, n_batch: int) -> None:
        lc = _llama_cpp()
        self.kind = kind
        self.path = gguf
        self.threads = threads
        self.version = str(lc.__version__)
        self.llm = lc.Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            seed=seed,
            verbose=False,
        )
        self._lc = lc
        self.vocab = int(self.llm.n_vocab())
        self.rng = np.random.default_rng(seed)

    def _prompt(self, length: int) -> list[int]:
        return [int(x) for x in self.rng.integers(0, self.vocab, size=length)]

    def _greedy(self) -> int:
        """The argmax of the last evaluated token's logits."""
        ptr = self._lc.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax())

    def prefill_once(self, point: PrefillPoint) -> tuple[float, float] | None:
        """Seconds to evaluate one prompt of `point.prompt_len` tokens, and the process CPU
        seconds meanwhile; None for batch > 1 (one sequence only)."""
        if point.batch != 1:
            return None
        ids = self._prompt(point.prompt_len)
        self.llm.reset()
        c0, t0 = time.process_time(), time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0, time.process_time() - c0

    def decode_once(self, point: DecodePoint) -> tuple[list[float], float] | None:
        """Step times of `point.steps` single-token steps after `point.warmup_steps` untimed ones,
        against a context of `point.context` tokens, and their CPU seconds; None for batch > 1."""
        if point.batch != 1:
            return None
        self.llm.reset()
        self.llm.eval(self._prompt(point.context))
        nxt = self._greedy()
        times, cpu = [], 0.0
        for i in range(point.warmup_steps + point.steps):
            c0, t0 = time.process_time(), time.perf_counter()
            self.llm.eval([nxt])
            nxt = self._greedy()
            if i >= point.warmup_steps:
                times.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
        return times, cpu

    def close(self) -> None:
        self.llm.close()


def llamacpp_kinds(spec: str | None, quantization: str | None) -> list[str]:
    """--llamacpp-types (comma-separated) or, without it, the peer of this --quantization."""
    kinds = [k.strip() for k in spec.split(",") if k.strip()] if spec else [LLAMACPP_PEERS[quantization]]
    bad = [k for k in kinds if k not in FTYPES]
    if bad or not kinds:
        raise SystemExit(f"kvpipe bench engine: --llamacpp-types takes {', '.join(FTYPES)}, got {bad or spec!r}")
    return kinds


def references(
    gguf: Path, kinds: list[str], workdir: Path, seed: int, threads: int, n_ctx: int, n_batch: int
) -> list[LlamaCppReference]:
    """One LlamaCppReference per type: the file itself where it is of that type, else a copy
    converted into `workdir` (reused by later runs that share it)."""
    own = gguf_type(gguf)
    refs = []
    for kind in kinds:
        path = gguf if kind == own else convert_gguf(gguf, workdir / f"{gguf.stem}.{kind}.gguf", kind, threads)
        refs.append(LlamaCppReference(path, kind, seed, threads, n_ctx, n_batch))
    return refs


def format_llamacpp(report: dict[str, Any]) -> str:
    """The llama.cpp rows of a `bench engine` report: per type, its time and kvpipe's ratio."""
    lc = report["config"].get("compare_llamacpp")
    if not lc:
        return ""
    q = report["config"].get("quantization") or "none"
    fused = report["config"].get("decode_fused_layer", "auto")
    rows = [
        f"llama.cpp {lc['version']} ({lc['threads']} threads) against kvpipe --quantization {q} "
        f"--decode-fused-layer {fused}"
    ]
    for x in report["prefill"]:
        for kind, r in x.get("llamacpp", {}).items():
            rows.append(
                f"  prefill {x['prompt_len']:>5} x{x['batch']}: llama.cpp {kind:<5} {r['ms_per_prefill']:>9.1f} ms, "
                f"kvpipe {x['ms_per_prefill']:>9.1f} ms, kvpipe/llama.cpp time {x['time_ratio_vs_llamacpp'][kind]:.2f}"
            )
    for x in report["decode"]:
        for kind, r in x.get("llamacpp", {}).items():
            rows.append(
                f"  decode batch {x['batch']}: llama.cpp {kind:<5} {r['ms_per_step']:>7.2f} ms/token, "
                f"kvpipe {x['ms_per_step']:>7.2f} ms/token, "
                f"kvpipe/llama.cpp time {x['step_ratio_vs_llamacpp'][kind]:.2f}"
            )
    return "\n".join(rows)
