"""A pool of long-lived gloo worker processes that runs many small distributed jobs.

Starting processes and importing torch costs seconds; a job on warm workers costs milliseconds.
Tests and ``meshc verify`` therefore run every case on one pool.  A job that fails (or hangs past
its timeout) takes the whole pool down, and the next job starts a fresh one: after a collective has
failed a process group cannot be trusted again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import forkserver
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs 3.11; only the type checker reads this

__all__ = ["PoolError", "RankContext", "WorkerPool"]


class PoolError(RuntimeError):
    """A job failed on some rank, timed out, or a worker died."""


@dataclass(frozen=True)
class RankContext:
    """What a job function learns about where it runs."""

    rank: int
    n_ranks: int
    world_size: int

    def mesh(self, axes: Sequence[tuple[str, int]]) -> Any:
        """A ``Mesh`` over the job's ranks 0 .. n_ranks - 1."""
        from meshllm_dsl.runtime.parallel.mesh import Mesh

        return Mesh.build(axes, ranks=range(self.n_ranks))


# Imported once in the fork server rather than in each worker (8 workers on 2 cores would import
# DTensor / DCP / pipelining 8 times over on the first job that needs them).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "meshllm_dsl.runtime",
    "meshllm_dsl.runtime.train.checkpoint",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, jobs: Any, results: Any, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    from meshllm_dsl.runtime.parallel.mesh import (
        end_group_creation,
        serve_group_creation,
        set_group_timeout,
    )

    # Ctrl-C reaches the whole foreground process group: only the parent should act on it (and
    # then close the pool), or the workers die first and the parent reports a broken pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    set_group_timeout(timedelta(seconds=timeout_s))
    results.put(("ready", rank, True, None))
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, n_ranks, payload = job
        if rank >= n_ranks:
            # Ranks outside the job still take part in creating its process groups.
            serve_group_creation()
            continue
        try:
            fn, args = pickle.loads(payload)  # may import the job's module: report its failure too
            out = fn(RankContext(rank, n_ranks, world), *args)
            if n_ranks < world:
                end_group_creation()
            results.put((job_id, rank, True, pickle.dumps(out)))
        except BaseException:  # noqa: BLE001 - the worker boundary: report any failure, then exit
            results.put((job_id, rank, False, traceback.format_exc()))
            # Exit rather than carry on: peers blocked in a collective with this rank then fail at
            # once (closed connection) instead of waiting for the gloo timeout.
            results.close()
            results.join_thread()
            os._exit(1)
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` gloo ranks on loopback, started lazily and restarted after any failure."""

    def __init__(
        self,
        world_size: int = 8,
        timeout: float = 60.0,
        start_timeout: float = 120.0,
        preload: Sequence[str] | None = None,
        on_report: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """``preload``: modules the fork server imports once for every worker (default: all the
        runtime may use; a caller that knows its jobs, like ``meshc verify``, starts faster with
        fewer).  ``on_report(phase, done, of)``: called as ranks report, phase ``"ready"`` (joined
        the process group) or ``"job"`` (finished the job), for a caller's progress display.
        ``timings`` holds when each phase of the last start and job ended (seconds, monotonic)."""
        self.world_size = world_size
        self.preload = list(_PRELOAD if preload is None else preload)
        self.timeout = timeout
        self.start_timeout = start_timeout
        self._procs: list[Any] = []
        self._jobs: list[Any] = []
        self._results: Any = None
        self._next_id = 0
        self.on_report = on_report
        self.timings: dict[str, float] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prestart(self) -> None:
        """Start the fork server now, without waiting: it imports ``preload`` (seconds) while the
        caller goes on with its own work; the first ``run`` then forks the workers from it."""
        # forkserver, with torch imported once in the server: a (re)start forks ready workers in
        # well under a second instead of importing torch in every spawned process (~2 s each).
        # Plain fork is unsafe: the parent may already hold torch / gloo threads.
        mp.get_context("forkserver").set_forkserver_preload([*self.preload, f"{__package__}._prefork"])
        forkserver.ensure_running()

    def _start(self) -> None:
        self.prestart()
        ctx = mp.get_context("forkserver")
        port = _free_port()
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self._jobs[r], self._results, self.timeout),
                daemon=True,
                name=f"meshllm-worker-{r}",
            )
            for r in range(self.world_size)
        ]
        self.timings["start"] = time.monotonic()
        try:
            for p in self._procs:
                p.start()
        except BaseException:  # interrupted while starting (Ctrl-C, SIGTERM): leave nothing behind
            self._abort()
            raise
        self.timings["forked"] = time.monotonic()
        ready = self._collect("ready", self.world_size, self.start_timeout)
        self.timings["ready"] = time.monotonic()
        assert len(ready) == self.world_size

    def _collect(self, job_id: Any, n: int, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        got: dict[int, Any] = {}
        while len(got) < n:
            try:
                jid, rank, ok, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    self._abort()
                    raise PoolError(
                        f"worker(s) died without reporting: {', '.join(dead)}"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(n)) - set(got))
                    self._abort()
                    what = "start" if job_id == "ready" else "finish"
                    raise PoolError(
                        f"job timed out after {timeout:.0f}s; ranks {missing} did not {what}"
                    ) from None
                continue
            if jid != job_id:
                continue
            if not ok:
                self._abort()
                raise PoolError(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
            if len(got) == 1:
                self.timings[f"{'ready' if job_id == 'ready' else 'job'} first"] = time.monotonic()
            if self.on_report is not None:
                self.on_report("ready" if job_id == "ready" else "job", len(got), n)
        return [got[r] for r in range(n)]

    def run(
        self, fn: Callable[..., Any], n_ranks: int, *args: Any, timeout: float | None = None
    ) -> list[Any]:
        """Run ``fn(RankContext, *args)`` on ranks 0 .. n_ranks - 1; return their results in rank order.

        ``fn`` must be a picklable top-level function.  Raises ``PoolError`` with the traceback of
        the first rank that failed.
        """
        if not 1 <= n_ranks <= self.world_size:
            raise ValueError(f"n_ranks must be in 1..{self.world_size}, got {n_ranks}")
        if not self._procs:
            self._start()
        self._next_id += 1
        payload = pickle.dumps((fn, args))
        self.timings["job start"] = time.monotonic()
        for q in self._jobs:
            q.put((self._next_id, n_ranks, payload))
        if self.on_report is not None:
            self.on_report("job", 0, n_ranks)
        raw = self._collect(self._next_id, n_ranks, self.timeout if timeout is None else timeout)
        self.timings["job end"] = time.monotonic()
        return [pickle.loads(r) for r in raw]

    def _abort(self) -> None:
        started = [p for p in self._procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=10)
        self._procs, self._jobs, self._results = [], [], None

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        if not self._procs:
            return
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            if p.pid is not None:
                p.join(timeout=10)
        self._abort()
