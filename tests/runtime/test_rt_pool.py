"""WorkerPool: reuse, sub-world jobs, failures that name their cause, timeouts, restarts."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from meshllm_dsl.runtime.jobs.pool import PoolError, RankContext, WorkerPool


def _sum_ranks(ctx: RankContext, axes: tuple[tuple[str, int], ...]) -> tuple[int, float]:
    mesh = ctx.mesh(axes)
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=mesh.group(*mesh.names))
    return mesh.index(*mesh.names), t.item()


def test_jobs_of_every_size_reuse_the_workers(pool: WorkerPool) -> None:
    pool.run(_sleep, 1, 0.0)  # the session pool may be starting: not part of the measurement
    start = time.monotonic()
    for n, axes in [
        (2, (("a", 2),)),
        (8, (("a", 2), ("b", 4))),
        (4, (("a", 2), ("b", 2))),
        (3, (("a", 3),)),
    ] * 25:
        assert pool.run(_sum_ranks, n, axes) == [(r, float(n * (n - 1) // 2)) for r in range(n)]
    assert time.monotonic() - start < 15  # a hundred jobs: ~10 ms each once groups exist


def _fail_on_rank_1(ctx: RankContext) -> None:
    mesh = ctx.mesh((("x", ctx.n_ranks),))
    if ctx.rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier(group=mesh.group("x"))  # the healthy rank waits on the broken one


def _sleep(ctx: RankContext, seconds: float) -> int:
    time.sleep(seconds if ctx.rank == 1 else 0)
    return ctx.rank


@pytest.fixture(scope="module")
def small_pool() -> Iterator[WorkerPool]:
    # Its own small pool: these tests restart it, which must not cost the shared pool a restart.
    with WorkerPool(world_size=2, timeout=30.0) as p:
        yield p


def test_failure_names_the_rank_and_the_cause_and_the_pool_recovers(small_pool: WorkerPool) -> None:
    start = time.monotonic()
    with pytest.raises(PoolError, match=r"(?s)rank 1 failed.*ValueError: rank one is broken"):
        small_pool.run(_fail_on_rank_1, 2)
    assert time.monotonic() - start < 20
    assert small_pool.run(_sleep, 2, 0.0) == [0, 1]


def test_a_hung_job_times_out_and_the_pool_recovers(small_pool: WorkerPool) -> None:
    start = time.monotonic()
    with pytest.raises(PoolError, match=r"timed out after 1s; ranks \[1\]"):
        small_pool.run(_sleep, 2, 60.0, timeout=1.0)
    assert time.monotonic() - start < 15
    assert small_pool.run(_sleep, 2, 0.0) == [0, 1]


def test_close_is_idempotent() -> None:
    p = WorkerPool(world_size=2)
    p.close()  # never started
    assert p.run(_sleep, 1, 0.0) == [0]
    p.close()
    p.close()
