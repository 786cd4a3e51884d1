"""`kvpipe bench plot`: draw recorded benchmark results again, without rerunning the benchmark.

    kvpipe bench plot docs/bench/engine_llamacpp_smollm2_s12_amd.json --out engine.png
    kvpipe bench plot docs/bench/pd_vs_colocated_*_int.json --out pd.png    # several runs, one plot

The plot is the one the benchmark's own --plot draws (bench/<name>/plot.py), chosen by the
result's kind (bench/result_kind.py). Several results of one kind make one plot where that kind
has one: engine runs side by side, serve sweeps at several link rates (exposed transfer against
T/C), --compare-colocated runs at several concurrencies.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpipe.bench.accuracy.plot import plot_accuracy
from kvpipe.bench.engine.plot import plot_engine
from kvpipe.bench.result_kind import Result, ResultKind, kind_of, load_results
from kvpipe.bench.serve.plot import result_plot
from kvpipe.bench.serve.runs_plot import plot_compare_runs, plot_link_sweep
from kvpipe.bench.transfer.plot import plot_transfer

Draw = Callable[[Sequence[Result], str], Path]


def _one(draw: Callable[[Result, str], Path], kind: ResultKind) -> Draw:
    def plot(results: Sequence[Result], path: str) -> Path:
        if len(results) != 1:
            raise ValueError(f"{kind.value}: one result per plot, got {len(results)}")
        return draw(results[0], path)

    return plot


def _serve(results: Sequence[Result], path: str) -> Path:
    if len(results) == 1:
        return result_plot(results[0], path)
    return (plot_compare_runs if "compare" in results[0] else plot_link_sweep)(results, path)


def _serve_run(results: Sequence[Result], path: str) -> Path:
    raise ValueError(
        "a single bench serve run's JSON holds its summary, not the per-request latencies its plot "
        "draws: give --plot (or --out) to the run itself"
    )


DRAW: dict[ResultKind, Draw] = {
    ResultKind.ENGINE: plot_engine,
    ResultKind.TRANSFER: _one(plot_transfer, ResultKind.TRANSFER),
    ResultKind.ACCURACY: _one(plot_accuracy, ResultKind.ACCURACY),
    ResultKind.SERVE_SWEEP: _serve,
    ResultKind.SERVE_COMPARE: _serve,
    ResultKind.SERVE_RUN: _serve_run,
}


def plot_files(paths: Sequence[str | Path], out: str | Path) -> Path:
    """Plot the results the files hold (all of one kind) into the PNG `out`; ValueError with the
    reason where they cannot be."""
    results = load_results(paths)
    kinds = {kind_of(r) for r in results}
    if len(kinds) != 1:
        raise ValueError(f"results of one kind per plot, got {', '.join(sorted(k.value for k in kinds))}")
    return DRAW[kinds.pop()](results, str(out))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE.json", help="recorded results (--out of a bench command)")
    p.add_argument("--out", required=True, metavar="PNG", help="the plot to write")


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    try:
        path = plot_files(args.files, args.out)
    except ValueError as e:
        raise SystemExit(f"kvpipe bench plot: {e}") from None
    print(f"wrote {path}")
    return 0
