"""Run a function on every rank of a gloo process group (CPU tensor parallelism): one spawned
process per rank, each result saved by its rank and loaded back in the test's process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvpipe.config import ParallelConfig


def run_ranks(fn: Callable[..., Any], world: int, tmp_path: Path, *args: Any) -> list[Any]:
    """`fn(ParallelConfig(world, rank), *args)` on each of `world` gloo ranks; returns the results
    by rank. `fn` must be a module-level function (the spawned processes import it by name)."""
    mp.spawn(_rank_main, args=(world, str(tmp_path / "rendezvous"), fn, args, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]


def _rank_main(rank: int, world: int, init_file: str, fn: Callable[..., Any], args: tuple, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", world_size=world, rank=rank)
    torch.save(fn(ParallelConfig(world, rank), *args), Path(out) / f"rank{rank}.pt")
    dist.barrier()  # every rank's result is on disk
    # Skip interpreter teardown (as kvpipe's TP workers do): gloo's threads, torn down at exit,
    # sometimes abort the process ("terminate called without an active exception") after the
    # work is done, which mp.spawn reports as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
