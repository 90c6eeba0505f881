"""How the runtime waits for its gloo collectives: polling while each rank has a core, else blocking.

Polling must change nothing but the wait: the same results bit for bit, the same errors when a peer
dies, and ``meshc run --profile`` still charging the wait to the collective.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402 - after the torch skip
from torch import nn  # noqa: E402

import meshllm_dsl.runtime as rt  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool  # noqa: E402
from meshllm_dsl.runtime.parallel import collectives  # noqa: E402


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a launcher around pytest may have set must not decide these tests."""
    for name in ("MESHLLM_GLOO_WAIT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)


def test_polls_only_on_cpu_while_each_local_rank_has_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_CORES", 4)
    x = torch.zeros(2)
    for ranks, want in (("1", True), ("4", True), ("5", False), ("64", False)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert collectives.polls(x) is want, ranks
    # Two nodes of 2 ranks: on other machines, each rank has a core; both on this one (a
    # rendezvous at a loopback address), 4 ranks share 4 cores, then 8 share them.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    for master, want in (("node001", True), ("localhost", True), ("127.0.0.1", True)):
        monkeypatch.setenv("MASTER_ADDR", master)
        assert collectives.polls(x) is want, master
    monkeypatch.setenv("WORLD_SIZE", "8")
    for master, want in (("node001", True), ("localhost", False), ("127.0.0.1", False), ("::1", False)):
        monkeypatch.setenv("MASTER_ADDR", master)
        assert collectives.polls(x) is want, master
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    # Not a CPU tensor (as a CUDA one under NCCL): never polled, whatever the core count.
    assert collectives.polls(torch.zeros(2, device="meta")) is False


class _SilentWork:
    """A Work that never reports completion (gloo's reduce_scatter_single is one)."""

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_wait_blocks_after_a_bounded_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    work, start = _SilentWork(), time.perf_counter()
    collectives.wait(work, torch.zeros(1))
    assert work.waited
    assert collectives._POLL_SECONDS <= time.perf_counter() - start < 10 * collectives._POLL_SECONDS + 1


def test_gloo_wait_can_be_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_CORES", 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    x = torch.zeros(2)
    for choice, want in (("auto", True), ("block", False), ("poll", True)):
        monkeypatch.setenv("MESHLLM_GLOO_WAIT", choice)
        assert collectives.polls(x) is want, choice
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert collectives.polls(x) is True  # poll: even with more ranks than cores, as asked
    monkeypatch.setenv("MESHLLM_GLOO_WAIT", "spin")
    with pytest.raises(ValueError, match="MESHLLM_GLOO_WAIT must be auto, poll or block, not 'spin'"):
        collectives.polls(x)
    monkeypatch.setenv("MESHLLM_GLOO_WAIT", "poll")
    assert collectives.polls(torch.zeros(2, device="meta")) is False  # never on a GPU tensor


def _run_collectives(mesh: Any) -> list[torch.Tensor]:
    """Every collective the runtime issues itself, forward and backward, on fixed inputs."""
    group = mesh.group("tensor")
    gen = torch.Generator().manual_seed(3 + mesh.rank)
    x = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64)
    out = [collectives.all_reduce_sum(x, group)]
    # gather / split and the sequence-parallel reduce-scatter, with their gradients.
    part = x.clone().requires_grad_()
    full = rt.gather_from(part, group, dim=1)
    scattered = rt.reduce_scatter_seq(full * (mesh.rank + 1), group)
    (scattered * scattered).sum().backward()
    out += [full, scattered, part.grad]
    # copy_to_linear: its backward all-reduces x's gradient asynchronously.
    layers = [nn.Linear(6, 3, dtype=torch.float64) for _ in range(2)]
    with torch.no_grad():
        for p in (q for m in layers for q in m.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    xi = collectives.all_reduce_sum(x, group).requires_grad_()
    a, b = rt.copy_to_linear(xi, group, *layers)
    (a * b).sum().backward()
    out += [a, b, xi.grad, *(q.grad for m in layers for q in m.parameters())]
    # The vocab-parallel loss (its max and sum all-reduces) and its gradient.
    logits = (10 * torch.randn(2, 4, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    targets = torch.arange(8).view(2, 4) % (5 * mesh.size("tensor"))
    loss = rt.vocab_parallel_cross_entropy(logits, targets, group, mesh.index("tensor") * 5)
    loss.backward()
    return [*out, loss.detach(), logits.grad]


@contextlib.contextmanager
def _local_ranks(n: int) -> Iterator[None]:
    """LOCAL_WORLD_SIZE = n for the block, then as before: the pool's workers outlive a job."""
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(n)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


def _polled_vs_blocked_job(ctx: RankContext) -> tuple[list[bool], list[float]]:
    mesh = ctx.mesh([("tensor", 2)])
    results, polled = [], []
    for local in (1, 1_000_000):  # a core for each rank; far more ranks than cores
        with _local_ranks(local):
            polled.append(collectives.polls(torch.zeros(1)))
            results.append(_run_collectives(mesh))
    polled_out, blocked_out = results
    return polled, [(p - q).abs().max().item() for p, q in zip(polled_out, blocked_out)]


def test_polled_collectives_equal_blocked_ones_bit_for_bit(pool: WorkerPool) -> None:
    for rank, (polled, diffs) in enumerate(pool.run(_polled_vs_blocked_job, 2)):
        assert polled == [True, False], rank
        assert len(diffs) == 13 and max(diffs) == 0.0, (rank, diffs)


def _profiled_wait_job(ctx: RankContext) -> tuple[float, float]:
    from meshllm_dsl.runtime.train.profile import CollectiveLog

    mesh = ctx.mesh([("tensor", 2)])
    group = mesh.group("tensor")
    with _local_ranks(1), CollectiveLog(mesh) as log:
        if mesh.rank == 1:
            time.sleep(0.3)  # rank 0 polls for this long inside its all-reduce
        collectives.all_reduce_sum(torch.ones(4), group)
    calls, _, seconds, _ = log.stats[("tensor", "all_reduce")]
    return calls, seconds


def test_profile_charges_a_polled_wait_to_its_collective_once(pool: WorkerPool) -> None:
    (calls, seconds), _ = pool.run(_profiled_wait_job, 2)
    assert calls == 1
    assert seconds >= 0.25  # the launch alone takes microseconds


def _dying_peer(rank: int, port: int, outcome: Any) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    x = torch.ones(8)
    collectives.all_reduce_sum(x, dist.group.WORLD)
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)  # dies between collectives, as a crashed rank does
    start = time.perf_counter()
    try:
        collectives.all_reduce_sum(x, dist.group.WORLD)
        outcome.put(("returned", collectives.polls(x), time.perf_counter() - start))
    except RuntimeError as err:
        outcome.put((str(err), collectives.polls(x), time.perf_counter() - start))


def test_a_polling_rank_fails_at_once_when_its_peer_dies() -> None:
    from meshllm_dsl.runtime.jobs.pool import _free_port

    ctx = mp.get_context("spawn")
    outcome = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_dying_peer, args=(r, port, outcome)) for r in range(2)]
    for p in procs:
        p.start()
    message, polled, seconds = outcome.get(timeout=120)
    for p in procs:
        p.join(30)
    assert polled
    assert "Connection closed by peer" in message
    assert seconds < 10  # not the group's 30 minute default timeout
