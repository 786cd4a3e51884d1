"""Where a benchmark's result goes besides its table: `--out FILE` (the JSON) and `--plot PNG` (the
benchmark's own plot of it; `kvpipe bench plot FILE.json --out PNG` draws a recorded one again).
Shared by bench engine, transfer, kv-accuracy and quant-accuracy (bench serve has its own emit,
whose plot defaults to --out's name)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

PlotFn = Callable[[Mapping[str, Any], str], Any]


def add_output_args(p: argparse.ArgumentParser) -> None:
    """--json, --out and --plot."""
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="also draw the result as a PNG (a recorded result: kvpipe bench plot FILE.json --out PNG)",
    )


def write_outputs(result: Mapping[str, Any], args: argparse.Namespace, plot: PlotFn) -> None:
    """--out: the JSON; --plot: `plot(result, path)`."""
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)
