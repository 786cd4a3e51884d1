"""Tensor parallelism over processes: rank 0 lives in the engine, ranks 1..N-1 are children.

Children are `python -m kvpipe.engine.tp_group` subprocesses (no multiprocessing spawn, so
nothing depends on the parent's __main__ being import-safe). Data plane: torch.distributed
(gloo on CPU, nccl on CUDA) for the model's all-reduces, with a file:// rendezvous in a private
temp dir (no ports to pick). Control plane: one socketpair per child carrying typed, pickled
messages; every step rank 0 sends the ForwardSpec, and all ranks run the same forward on their
shard. Children wait on their pipe, never on a collective, so an idle
server needs no heartbeat; a watchdog thread exits a child as soon as its parent is gone
(os.getppid() changes), even while it is blocked inside a collective.

With a KV connector (PD servers) every child builds its own connector worker from the
connector's `worker_factory` and runs it SPMD: the ForwardSpec's connector meta tells it what to
send from its own layer-group hooks; `CommandMsg`s run between forwards (set-up, sends that need
the sampled token, aborts), a `ReplyMsg` answers those that want one, and the child polls its
worker while idle and pushes `ReportMsg`s (finished rooms, counters) back on the same pipe.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ParallelConfig, ServerConfig
from kvpipe.engine.batch import ForwardSpec
from kvpipe.engine.connector import EngineRole, KVConnectorWorker, WorkerFactory
from kvpipe.engine.cpu_threads import apply_cpu_threads, server_cpu_threads
from kvpipe.engine.errors import EngineLost
from kvpipe.engine.host_memory import tune_malloc
from kvpipe.engine.model_runner import GroupCallback, ModelRunner, snapshot_slots
from kvpipe.engine.store_tp import RankTier
from kvpipe.engine.tp_messages import (
    CommandMsg,
    DraftStepMsg,
    ErrorMsg,
    HelloMsg,
    ReadyMsg,
    ReplyMsg,
    ReportMsg,
    StartMsg,
    StepMsg,
    StopMsg,
    TierMsg,
)
from kvpipe.model.checkpoint.loader import load_model

logger = logging.getLogger(__name__)

# rendezvous and every collective give up after this long (a dead peer mid-forward, a child
# that never started); ranks run in lockstep, so a healthy all-reduce waits far less
COLLECTIVE_TIMEOUT_S = 180.0
START_TIMEOUT_S = 180.0  # rendezvous + model load of all ranks


def rank_device(device: str, rank: int) -> str:
    """'cuda' -> 'cuda:<rank>' (one GPU per rank); anything else unchanged."""
    return f"cuda:{rank}" if device == "cuda" else device


def build_runner(cfg: ServerConfig, parallel: ParallelConfig, device: str, role: EngineRole) -> ModelRunner:
    tune_malloc()  # every rank's process: step activations reuse heap pages instead of faulting new ones
    group = dist.group.WORLD if parallel.tp_size > 1 else None
    model = load_model(
        cfg.model_path,
        parallel,
        device,
        None if cfg.dtype == "auto" else cfg.dtype,
        group,
        quantization=cfg.quantization,
        decode_fused_layer=cfg.decode_fused_layer,
    )
    # a hybrid target keeps per-position states of its verify forwards (cache/verify_states.py);
    # a PD prefill never verifies
    verify = cfg.speculative.max_drafts + 1 if cfg.speculative.enabled and role.verifies_drafts else 0
    return ModelRunner(model, cfg.cache, device, cfg.scheduler, snapshot_slots(cfg, role), verify_positions=verify)


def build_draft_runner(
    cfg: ServerConfig, parallel: ParallelConfig, device: str, snapshot_slots: int = 0
) -> ModelRunner:
    """This rank's shard of a STANDALONE draft model (engine/spec/draft_model.py) with its own KV pool:
    heads split over the target's TP group (as SGLang runs the draft worker with the target's
    TP), as many pages as the target's, in the model's compute dtype. `snapshot_slots`: a hybrid
    draft's extra recurrent-state slots (TP 1, engine/spec/draft_state.py)."""
    path = cfg.speculative.draft_model_path
    assert path is not None
    group = dist.group.WORLD if parallel.tp_size > 1 else None
    model = load_model(path, parallel, device, None if cfg.dtype == "auto" else cfg.dtype, group)
    return ModelRunner(
        model, replace(cfg.cache, kv_cache_dtype="auto"), device, cfg.scheduler, snapshot_slots=snapshot_slots
    )


def _init_rank(cfg: ServerConfig, rank: int, init_method: str) -> str:
    device = rank_device(cfg.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    # before the model loads: the ranks share the server's threads (--cpu-threads or its cores)
    apply_cpu_threads(server_cpu_threads(cfg))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=cfg.tp_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return device


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)  # parent died: leave at once, even from inside a collective
        time.sleep(0.5)


def load_factory(path: str) -> WorkerFactory:
    """'package.module:function' -> the function (imported here, lazily)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def worker_main(fd: int, parent_pid: int) -> None:
    """Entry point of TP rank >= 1 (a child process); everything else arrives on the pipe."""
    # Ctrl-C reaches the whole process group; rank 0 decides when this rank stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    conn = Connection(fd)
    code, rank = 0, -1
    worker: KVConnectorWorker | None = None
    try:
        start = conn.recv()
        rank = start.rank
        # this rank's own log lines (its model load among them) at the server's level, to the
        # server's output (inherited stderr)
        logging.basicConfig(
            level=start.cfg.log_level.upper(), format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s"
        )
        conn.send(HelloMsg(rank))
        device = _init_rank(start.cfg, rank, start.init_method)
        parallel = ParallelConfig(start.cfg.tp_size, rank)
        runner = build_runner(start.cfg, parallel, device, start.role)
        draft = build_draft_runner(start.cfg, parallel, device) if start.sharded_draft else None
        if start.worker_factory is not None:
            worker = load_factory(start.worker_factory)(
                start.cfg, rank, runner.pool, runner.model.cfg.kv_cache_heads, runner.state_pool
            )
            if draft is not None:  # its shard of the draft KV moves with the target's (PD)
                worker.set_draft_pool(draft.pool, draft.model.cfg.kv_cache_heads)
        conn.send(ReadyMsg(rank))
        tier = RankTier(start.cfg, runner.pool, rank) if start.cfg.hicache.enabled else None
        _serve(conn, rank, runner, worker, draft, tier)
    except EOFError:
        code = 2
    except BaseException:  # noqa: BLE001 - reported to rank 0, then this rank exits
        code = 1
        text = traceback.format_exc()
        print(f"kvpipe TP rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
        try:
            conn.send(ErrorMsg(rank, text))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()
        if worker is not None:
            worker.close()
    # skip interpreter teardown: gloo/nccl destructors may block on peers that are gone
    os._exit(code)


def _serve(
    conn: Connection,
    rank: int,
    runner: ModelRunner,
    worker: KVConnectorWorker | None,
    draft: ModelRunner | None = None,
    tier: RankTier | None = None,
) -> None:
    """A child's loop: forwards (the target's, the draft model's), connector and KV-tier
    commands in pipe order; while idle, the worker's news."""
    while True:
        timeout = worker.poll_interval_s if worker is not None else None
        if conn.poll(timeout):
            msg = conn.recv()  # EOFError when rank 0 closed the pipe
            if isinstance(msg, StopMsg):
                return
            if isinstance(msg, StepMsg):
                meta = msg.spec.connector_meta
                callback = None
                if worker is not None:
                    worker.before_forward(meta)
                    callback = lambda start, end, fb, w=worker, m=meta: w.after_layers(m, start, end)  # noqa: E731
                runner.run(msg.spec, callback)
            elif isinstance(msg, DraftStepMsg):
                if draft is None:
                    raise TypeError(f"TP rank {rank} has no draft model for a draft forward")
                if msg.spec is not None:
                    draft.run(msg.spec)
                if msg.after is not None and worker is not None:
                    worker.after_layers(*msg.after)
            elif isinstance(msg, CommandMsg):
                if worker is None:
                    raise TypeError(f"TP rank {rank} has no KV connector worker for {type(msg.cmd).__name__}")
                if not msg.reply:
                    worker.handle(msg.cmd)  # a failure here is this rank's failure (ErrorMsg, exit)
                else:
                    try:
                        conn.send(ReplyMsg(rank, worker.handle(msg.cmd)))
                    except Exception:  # noqa: BLE001 - rank 0 raises it where it called
                        conn.send(ReplyMsg(rank, None, traceback.format_exc()))
            elif isinstance(msg, TierMsg):
                if tier is None:
                    raise TypeError(f"TP rank {rank} has no KV tier for {type(msg.cmd).__name__}")
                answer = tier.handle(msg.cmd)  # a failure is this rank's failure (ErrorMsg, exit)
                if msg.reply:
                    conn.send(ReplyMsg(rank, answer))
            else:
                raise TypeError(f"TP rank {rank} got an unexpected {type(msg).__name__}")
            if conn.poll(0):
                continue  # messages first: a step's commands land together
        if worker is not None:
            news = worker.poll()
            if news is not None:
                conn.send(ReportMsg(rank, news))


class TPGroup:
    """Rank 0's handle on a TP group: runs its own shard and drives ranks 1..N-1."""

    def __init__(
        self,
        cfg: ServerConfig,
        worker_factory: str | None = None,
        role: EngineRole | None = None,
        sharded_draft: bool = False,
    ) -> None:
        """`worker_factory`: the KV connector's (every child builds its worker); `role`: what the
        engine does (EngineRole.of its connector); `sharded_draft`: every rank loads its shard of
        a draft model (engine/spec/registry.py, DraftKV.SHARDED)."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process; one TP engine per process")
        role = role or EngineRole()
        self.cfg = cfg
        self._tmp = tempfile.mkdtemp(prefix="kvpipe-tp-")
        init_method = f"file://{os.path.join(self._tmp, 'rendezvous')}"
        self.tp_size = cfg.tp_size
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._reports: list[tuple[int, object]] = []  # children's ReportMsgs read while waiting for something else
        self._gone: dict[int, str] = {}  # child rank -> why it can no longer take part
        try:
            for rank in range(1, cfg.tp_size):
                mine, theirs = socket.socketpair()
                fd = theirs.fileno()
                p = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "kvpipe.engine.tp_group",
                        "--fd",
                        str(fd),
                        "--parent-pid",
                        str(os.getpid()),
                    ],
                    pass_fds=(fd,),
                )
                theirs.close()
                self._procs.append(p)
                self._conns.append(Connection(mine.detach()))
                self._conns[-1].send(StartMsg(cfg, rank, init_method, worker_factory, role, sharded_draft))
            # join the rendezvous only once every child is alive and importable
            self._wait_for(HelloMsg, "start")
            self.device = _init_rank(cfg, 0, init_method)
            self.runner = build_runner(cfg, ParallelConfig(cfg.tp_size, 0), self.device, role)
            self._wait_for(ReadyMsg, "load the model")
        except BaseException:
            self.shutdown()
            raise

    def _wait_for(self, kind: type, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = dict(enumerate(self._conns, start=1))
        while pending:
            for rank, conn in list(pending.items()):
                if conn.poll(0.05):
                    msg = conn.recv()
                    if isinstance(msg, ErrorMsg):
                        raise RuntimeError(f"TP rank {msg.rank} failed to {what}:\n{msg.text}")
                    if isinstance(msg, kind):
                        pending.pop(rank)
                elif self._procs[rank - 1].poll() is not None:
                    raise RuntimeError(
                        f"TP rank {rank} exited with code {self._procs[rank - 1].returncode} before it could {what}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP ranks {sorted(pending)} did not {what} within {START_TIMEOUT_S:.0f}s")

    @property
    def pool(self) -> KVPool:
        return self.runner.pool

    def run(self, spec: ForwardSpec, on_group_done: GroupCallback | None = None) -> torch.Tensor | None:
        """Every rank forwards `spec`; `on_group_done` runs on rank 0 once rank 0 has stored each
        layer group's KV (ModelRunner.run); every child's connector worker ships its own shard
        from its own runner's callback, so no rank waits on another's store."""
        self._to_children(StepMsg(spec))
        return self._run_here(lambda: self.runner.run(spec, on_group_done))

    def run_draft(
        self, draft: ModelRunner, spec: ForwardSpec | None, after: tuple[object, int, int] | None = None
    ) -> torch.Tensor | None:
        """Every rank forwards `spec` on its shard of the draft model (`draft`: rank 0's); with
        `after`, the children's connector workers then ship those send layers (rank 0's caller
        does its own). Returns rank 0's logits."""
        self._to_children(DraftStepMsg(spec, after))
        return self._run_here(lambda: None if spec is None else draft.run(spec))

    def _to_children(self, msg: StepMsg | DraftStepMsg) -> None:
        for rank, conn in enumerate(self._conns, start=1):
            if self._procs[rank - 1].poll() is not None:
                raise EngineLost(f"TP rank {rank} is gone (exit code {self._procs[rank - 1].returncode})")
            try:
                conn.send(msg)
            except OSError as e:
                raise EngineLost(f"TP rank {rank} is unreachable: {e}") from e

    def _run_here(self, forward: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """Rank 0's part of a forward the children run too; a failure names the ranks that died."""
        try:
            return forward()
        except Exception as e:
            why = f"TP forward failed: {e}{self._child_errors()}"
            if self.gone():  # a rank died under the collective: no later forward can succeed
                raise EngineLost(why) from e
            raise RuntimeError(why) from e

    def _child_errors(self) -> str:
        """Error reports children sent before exiting (a failed child breaks rank 0's collective)."""
        self.reports_into_buffer()
        texts = [f"\nTP rank {rank}: {why}" for rank, why in sorted(self._gone.items())]
        return "".join(texts)

    def tier_command(self, cmd: object, reply: bool) -> None:
        """Send `cmd` to every live child's side of the KV tier (engine/store_tp.py); with
        `reply`, read the answers with replies()."""
        for rank, conn in enumerate(self._conns, start=1):
            if rank in self._gone:
                continue
            try:
                conn.send(TierMsg(cmd, reply))
            except (OSError, ValueError) as e:
                self._gone.setdefault(rank, f"TP rank {rank} is unreachable ({e}): its process exited")

    # ---- the connector workers' channel (kvpipe/engine/connector_workers.py) ------------------------
    def command(self, cmd: object, reply: bool) -> None:
        """Send `cmd` to every live child's connector worker (after the forward it may be in)."""
        for rank, conn in enumerate(self._conns, start=1):
            if rank in self._gone:
                continue
            try:
                conn.send(CommandMsg(cmd, reply))
            except (OSError, ValueError) as e:
                self._gone.setdefault(rank, f"TP rank {rank} is unreachable ({e}): its process exited")

    def replies(self, timeout_s: float) -> list[object]:
        """The reply of every child (in rank order) to the last `command(..., reply=True)`."""
        deadline = time.monotonic() + timeout_s
        out: list[object] = []
        for rank, conn in enumerate(self._conns, start=1):
            while True:
                if rank in self._gone:
                    raise RuntimeError(self._gone[rank])
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"TP rank {rank} did not answer its KV connector command within {timeout_s:.0f}s"
                    )
                msg = self._read(rank, conn, 0.05)
                if isinstance(msg, ReplyMsg):
                    if msg.error is not None:
                        raise RuntimeError(f"TP rank {rank}'s KV connector worker failed:\n{msg.error}")
                    out.append(msg.reply)
                    break
        return out

    def reports(self) -> list[tuple[int, object]]:
        """(rank, news) the children's workers pushed since the last call."""
        self.reports_into_buffer()
        out, self._reports = self._reports, []
        return out

    def reports_into_buffer(self, max_reads: int = 4096) -> None:
        for rank, conn in enumerate(self._conns, start=1):
            for _ in range(max_reads):
                if rank in self._gone or self._read(rank, conn, 0) is None:
                    break

    def gone(self) -> dict[int, str]:
        """Children that exited (or failed), and why; their transfers cannot finish."""
        for rank, p in enumerate(self._procs, start=1):
            if rank not in self._gone and p.poll() is not None:
                self.reports_into_buffer()  # its last words may name the cause
                self._gone.setdefault(rank, f"TP rank {rank} exited (exit code {p.returncode})")
        return dict(self._gone)

    def _read(self, rank: int, conn: Connection, timeout: float) -> object | None:
        """One message from a child, if one comes within `timeout`; reports are buffered,
        errors and EOF mark the child gone."""
        try:
            if not conn.poll(timeout):
                return None
            msg = conn.recv()
        except (EOFError, OSError):
            self._gone.setdefault(rank, f"TP rank {rank} exited (its pipe closed)")
            return None
        if isinstance(msg, ReportMsg):
            self._reports.append((msg.rank, msg.news))
            return msg
        if isinstance(msg, ErrorMsg):
            self._gone[rank] = f"TP rank {rank} failed: {msg.text.strip()[-2000:]}"
            return msg
        return msg

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop message, join with timeout, then terminate/kill what is left. Idempotent."""
        for conn in self._conns:
            try:
                conn.send(StopMsg())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self._procs:
            for stop in (p.terminate, p.kill):
                if p.poll() is None:
                    stop()
                    try:
                        p.wait(2.0)
                    except subprocess.TimeoutExpired:
                        pass
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description="kvpipe TP worker (started by the engine, not by hand)")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args()
    worker_main(args.fd, args.parent_pid)


if __name__ == "__main__":
    # run the copy imported under its real name, so pickled messages name
    # kvpipe.engine.tp_group.*, not __main__.*
    from kvpipe.engine.tp_group import main as _main

    _main()
