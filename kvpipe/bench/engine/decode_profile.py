"""Where a decode step's time goes: `python -m kvpipe.bench.engine.decode_profile` (issue 31).

--batch requests (default one; random prompts of --context tokens, greedy, EOS ignored) decode through the real
engine path (Engine.step, as `bench engine`'s decode loop); after --warmup untimed steps, --steps
steps are timed plainly (the median is the step time), then --steps more run under cProfile and
the cumulative time of each component is reported per step. cProfile adds its own cost to every
Python call, so the components add up to more than the plain step time; read the shares, and the
plain median for the absolute figure.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

import numpy as np

from kvpipe.config import DECODE_FUSED_LAYER_MODES, CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.cpu_threads import apply_cpu_threads, server_cpu_threads
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import Req, SamplingParams
from kvpipe.model.checkpoint.default_model import resolve_model_path

Fn = tuple[str, str]  # (file suffix, function name); builtins: ("", a substring of their name)
LAYER_CALLERS: tuple[Fn, ...] = (
    ("model/layers/gqa_attention.py", "forward"),
    ("model/layers/gqa_attention.py", "_forward_fused"),
    ("model/layers/mlp.py", "forward"),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="checkpoint (default: the default model, SmolLM2-135M)")
    p.add_argument("--quantization", default=None, help="w8a16 or w4a16 (default: none)")
    p.add_argument(
        "--decode-fused-layer",
        choices=list(DECODE_FUSED_LAYER_MODES),
        default=ServerConfig.decode_fused_layer,
        help="the layers as one C++ call each (model/cpu/fused_decode.py); off: the modules, op by op",
    )
    p.add_argument(
        "--ab",
        action="store_true",
        help="instead of the profile: time the step with the fused layers and with the modules, "
        "alternating step by step in one engine (same weights, same pool), and report their medians' ratio",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--context", type=int, default=256, help="prompt tokens before decoding")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps first")
    p.add_argument("--steps", type=int, default=32, help="timed steps, and profiled steps")


def _engine(args: argparse.Namespace) -> Engine:
    cfg = ServerConfig(
        model_path=resolve_model_path(args.model_path),
        seed=0,
        log_level="warning",
        cpu_threads=args.threads,
        cache=CacheConfig(
            page_size=64, max_total_tokens=args.batch * (args.context + args.warmup + 2 * args.steps + 128)
        ),
        scheduler=SchedulerConfig(max_running_requests=max(8, args.batch)),
        quantization=args.quantization,
        decode_fused_layer=args.decode_fused_layer,
    )
    apply_cpu_threads(server_cpu_threads(cfg))
    return Engine(cfg)


class _Table:
    """cProfile's table: cumulative seconds of a function, in all or from some callers."""

    def __init__(self, prof: cProfile.Profile) -> None:
        self.stats: dict[tuple[str, int, str], Any] = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    @staticmethod
    def _is(key: tuple[str, int, str], fn: Fn) -> bool:
        file, _, name = key
        return fn[1] in name if fn[0] == "" else file.endswith(fn[0]) and name == fn[1]

    def cum(self, fn: Fn, callers: tuple[Fn, ...] | None = None) -> float:
        total = 0.0
        for key, (_, _, _, ct, by) in self.stats.items():
            if not self._is(key, fn):
                continue
            if callers is None:
                total += ct
            else:
                total += sum(v[3] for c, v in by.items() if any(self._is(c, f) for f in callers))
        return total


def _components(t: _Table, num_layers: int) -> dict[str, float]:
    """Seconds of each part of the profiled steps (no part nests in another). cProfile's callers
    of a module's forward are torch's Module.__call__, so a part is a function's time in all its
    calls: the GEMMs are every Linear's (a tied lm_head is not one), the layers' norms the share
    2L / (2L + 1) of RMSNorm's (the final norm is the last one). With --decode-fused-layer the
    layers are one C++ call each, a part of its own with nothing inside it visible."""
    fused = t.cum(("model/cpu/fused_decode.py", "run"))
    layers = t.cum(("model/layers/decoder_layer.py", "forward")) + fused
    norms = 0.0 if fused else t.cum(("model/layers/norms.py", "forward")) * 2 * num_layers / (2 * num_layers + 1)
    inside = {
        "fused decoder layers (one C++ call each: everything of the layers)": fused,
        "GEMMs of the layers (q/k/v, o, gate/up, down)": t.cum(("model/layers/linear.py", "forward")),
        "RoPE + K/V store": t.cum(("", "rope_store"))
        + t.cum(("model/layers/rope.py", "apply_rope"))
        + t.cum(("cache/kv_pool.py", "write")),
        "decode attention kernel": t.cum(("model/layers/attention.py", "decode_attention")),
        "RMSNorms of the layers": norms,
        "SwiGLU silu": t.cum(("nn/functional.py", "silu")),
    }
    inside["rest of the layers (residual adds, SwiGLU mul, views, module calls)"] = layers - sum(inside.values())
    outside = {
        "logits (final norm + lm_head)": t.cum(("model/families/causal_lm.py", "compute_logits")),
        "sampler": t.cum(("engine/sampler.py", "sample")),
        "batch build, RoPE tables, embedding": t.cum(("engine/model_runner.py", "build_batch"))
        + t.cum(("model/families/causal_lm.py", "rope"))
        + t.cum(("model/families/causal_lm.py", "embed")),
        "scheduler (schedule, commit)": t.cum(("engine/scheduler.py", "schedule"))
        + t.cum(("engine/scheduler.py", "commit")),
    }
    outside["rest of Engine.step"] = t.cum(("engine/engine.py", "step")) - layers - sum(outside.values())
    return {**inside, **outside}


def _ab(engine: Engine, steps: int) -> dict[str, Any]:
    """Alternate steps with the fused layers and without (model.fused_decode set and unset), so a
    shared machine's load drift hits both alike; the medians and their ratio."""
    model = engine.model
    fused = model.fused_decode
    if fused is None:
        raise SystemExit("decode_profile --ab: the engine has no fused layers (--decode-fused-layer off?)")
    times: dict[str, list[float]] = {"fused": [], "modules": []}
    try:
        for i in range(2 * steps):
            name = "fused" if i % 2 == 0 else "modules"
            model.fused_decode = fused if name == "fused" else None
            t0 = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t0)
    finally:
        model.fused_decode = fused
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"fused_ms": med["fused"], "modules_ms": med["modules"], "fused_over_modules": med["fused"] / med["modules"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine(args)
    try:
        rng = np.random.default_rng(0)
        params = SamplingParams(max_new_tokens=args.warmup + 2 * args.steps + 4, temperature=0.0, ignore_eos=True)
        reqs = [
            Req(f"profile-{i}", rng.integers(0, engine.model_config.vocab_size, size=args.context).tolist(), params)
            for i in range(args.batch)
        ]
        for req in reqs:
            engine.add_request(req)
        while not all(r.output_ids for r in reqs):  # the prefills
            engine.step()
        for _ in range(args.warmup):
            engine.step()
        if args.ab:
            ab = _ab(engine, args.steps)
            return {"quantization": args.quantization, "threads": args.threads, "batch": args.batch, "ab": ab}
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        prof.disable()
        profiled = time.perf_counter() - t0
        parts = _components(_Table(prof), engine.model_config.num_layers)
        parts = {k: 1e3 * v / args.steps for k, v in parts.items()}
    finally:
        engine.shutdown()
    return {
        "quantization": args.quantization,
        "decode_fused_layer": args.decode_fused_layer,
        "threads": args.threads,
        "step_ms_median": 1e3 * statistics.median(times),
        "profiled_step_ms": 1e3 * profiled / args.steps,
        "components_ms": parts,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpipe.bench.engine.decode_profile", description=__doc__.split("\n")[0])
    add_args(p)
    res = run(p.parse_args(argv))
    if "ab" in res:
        ab = res["ab"]
        print(
            f"quantization={res['quantization']} threads={res['threads']} batch={res['batch']}: decode step median "
            f"{ab['fused_ms']:.2f} ms fused, {ab['modules_ms']:.2f} ms modules, "
            f"fused/modules {ab['fused_over_modules']:.3f} (alternating step by step)"
        )
        return 0
    print(f"quantization={res['quantization']} decode_fused_layer={res['decode_fused_layer']} threads={res['threads']}")
    print(f"decode step: median {res['step_ms_median']:.2f} ms plain, {res['profiled_step_ms']:.2f} ms under cProfile")
    for name, ms in res["components_ms"].items():
        print(f"  {name:66s} {ms:7.2f} ms/step ({100 * ms / res['profiled_step_ms']:4.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
