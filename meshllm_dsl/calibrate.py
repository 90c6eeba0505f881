"""`meshc calibrate`: measure this machine and write a `device NAME { ... }` declaration.

Runs on a pool of gloo (CPU) worker processes, each with one thread as under torchrun, all at once
(as the ranks of a job share the machine):

  tflops    dense fp32 matmul throughput per process, median over sizes 256 and 512
  mfu       1: `tflops` is already what a matmul reaches, not a datasheet peak
  latency   median wall time of an 8-byte all-reduce over all the processes (microseconds)
  intra     all-reduce bus bandwidth (GB/s): ring bytes 2 (n - 1) / n x size over the time a 4 MiB
            all-reduce takes beyond the latency; `inter` is set to the same (one host)
  memory    physical memory / processes (GiB): what each rank may use

Include the file from a spec (`include "devices.mesh"`) and name the device in the mesh
(`device = NAME`); `meshc plan` and `meshc run --profile` then use it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from meshllm_dsl.names import identifier_problem


def _job(ctx: Any) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    group = dist.new_group(list(range(ctx.n_ranks))) if ctx.n_ranks < ctx.world_size else None
    flops = []
    for n in (256, 512):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        reps = max(3, int(2e8 / (2 * n**3)))
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        flops.append(2 * n**3 * reps / (time.perf_counter() - start))
    times: dict[int, float] = {}
    for numel, reps in ((2, 50), (1 << 20, 5)):
        t = torch.ones(numel)
        dist.all_reduce(t, group=group)  # warm-up: connections made
        samples = []
        for _ in range(reps):
            dist.barrier(group=group)
            start = time.perf_counter()
            # [numel]: timing only.
            dist.all_reduce(t, group=group)
            samples.append(time.perf_counter() - start)
        times[numel] = statistics.median(samples)
    return {"flops": statistics.median(flops), "small_s": times[2], "big_s": times[1 << 20]}


def calibrate(name: str, ranks: int) -> str:
    """The declaration text for this machine measured with ``ranks`` processes."""
    from meshllm_dsl.runtime.pool import WorkerPool

    with WorkerPool(world_size=ranks, timeout=600.0, preload=["torch", "torch.distributed"]) as pool:
        per_rank = pool.run(_job, ranks)
    tflops = statistics.median(r["flops"] for r in per_rank) / 1e12
    small = statistics.median(r["small_s"] for r in per_rank)
    big = statistics.median(r["big_s"] for r in per_rank)
    size = 4 * (1 << 20)
    wire = 2 * (ranks - 1) / ranks * size if ranks > 1 else size
    gbps = wire / max(big - small, 1e-9) / 1e9
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / ranks
    return (
        f"# Written by `meshc calibrate --device {name} --ranks {ranks}` on this machine "
        f"({os.cpu_count()} CPUs, gloo, 1 thread per process).\n"
        f"# fp32 matmul {tflops * 1e3:.2f} GFLOP/s per process; all-reduce of 8 bytes "
        f"{small * 1e6:.0f} us, of 4 MiB {big * 1e3:.1f} ms over {ranks} processes.\n"
        f"device {name} {{\n"
        f"    memory = {mem_gib:.1f}\n"
        f"    tflops = {tflops:.6f}\n"
        f"    mfu = 1\n"
        f"    intra = {gbps:.3f}\n"
        f"    inter = {gbps:.3f}\n"
        f"    per_host = {max(64, ranks)}\n"
        f"    latency = {small * 1e6:.1f}\n"
        f"}}\n"
    )


def cmd_calibrate(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli import UsageError

    problem = identifier_problem(args.device)
    if problem:
        raise UsageError(f"--device {args.device!r} {problem}")
    if args.ranks < 1:
        raise UsageError("--ranks must be at least 1")
    print(f"meshc: measuring with {args.ranks} processes ...", file=sys.stderr)
    text = calibrate(args.device, args.ranks)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = sub.add_parser("calibrate", help="measure this machine; write a `device` declaration the planner uses")
    c.add_argument("--device", default="calibrated", help="the device's name (default: calibrated)")
    c.add_argument("--ranks", type=int, default=2, help="processes to measure with, as a plan would run (default 2)")
    c.add_argument("-o", "--output", metavar="FILE", help="write the declaration here (default: print it)")
    c.set_defaults(func=cmd_calibrate)
