"""Which benchmark wrote a recorded JSON result, told from its shape (results carry no kind field;
the recorded ones in docs/bench predate any), and the results a set of files holds."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

Result = Mapping[str, Any]


class ResultKind(Enum):
    ENGINE = "bench engine"
    TRANSFER = "bench transfer"
    ACCURACY = "bench kv-accuracy / quant-accuracy"
    SERVE_SWEEP = "bench serve sweep"  # stacks started per mode (--sweep-prompt-lens)
    SERVE_COMPARE = "bench serve --compare-colocated"
    SERVE_RUN = "bench serve single run"  # against --url: summary only, no per-request records


def kind_of(result: Result) -> ResultKind:
    """The benchmark that wrote `result`; ValueError for anything else."""
    if "config" in result and ("prefill" in result or "decode" in result):
        return ResultKind.ENGINE
    if "lengths" in result and "config" in result:
        return ResultKind.TRANSFER
    rows = result.get("rows")
    if rows and "token_agreement" in rows[0]:
        return ResultKind.ACCURACY
    if rows and "mode" in rows[0] and "workload" in result:
        return ResultKind.SERVE_COMPARE if "compare" in result else ResultKind.SERVE_SWEEP
    if "summary" in result and "workload" in result:
        return ResultKind.SERVE_RUN
    raise ValueError(f"not a kvpipe benchmark result (keys: {', '.join(sorted(result)) or 'none'})")


def load_results(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every result in the files: a file of one result, or one with `runs` (several results of one
    invocation, e.g. bench engine --quantization a,b, or runs gathered in one file), gives each."""
    results: list[dict[str, Any]] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a JSON object expected")
        runs = data.get("runs")
        results.extend(runs if isinstance(runs, list) else [data])
    if not results:
        raise ValueError("no results in the files given")
    return results
