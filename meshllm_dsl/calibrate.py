"""`meshc calibrate`: measure this machine and write a `device NAME { ... }` declaration.

Runs on a pool of gloo (CPU) worker processes, each with one thread as under torchrun. Rates are
those of one rank running alone (the others wait at a barrier); `cores` says how they share the
machine (other users' work included, as it is when the job runs):

  tflops          dense fp32 matmul throughput per CPU second, median over sizes 256 and 512
  mfu             1: `tflops` is already what a matmul reaches, not a datasheet peak
  kernel          host CPU time per framework kernel (microseconds): a tiny Llama block's forward
                  and backward and an AdamW step on 8 x 32 tensors (no arithmetic to speak of),
                  divided by the kernels it dispatched (counted by runtime.profile.LiveBytes)
  cores           how many ranks' work the machine gets through at once: processes x the mini
                  step's CPU time alone / its wall time with every process running it together
                  (median of 5 windows of 0.4 s; other users' work counts against it, as in a run)
  latency         median wall time of an 8-byte all-reduce between two processes (microseconds)
  collective_cpu  median CPU time (all threads) one such call costs its process when its peer comes
                  5 ms late
                  after 3 mini steps, as in a step on time-shared cores (the call sleeps and is woken)
  intra           all-reduce bus bandwidth (GB/s) of two processes: 4 MiB over the time it takes
                  beyond the latency; `inter` is set to the same (one host)
  memory          physical memory / processes (GiB): what each rank may use

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


def _mini_model() -> Any:
    """A Llama block at 8 tokens x 32 dims with its optimizer: the kernels of a training step."""
    import torch
    from torch import nn

    from meshllm_dsl.runtime import layers as rt

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm, self.mlp_norm = rt.RMSNorm(32), rt.RMSNorm(32)
            self.q, self.k, self.v, self.o = (nn.Linear(32, 32, bias=False) for _ in range(4))
            self.gate, self.up, self.down = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            h = self.attn_norm(x)
            q, k = rt.apply_rotary(self.q(h).view(b, s, 4, 8), self.k(h).view(b, s, 4, 8), rt.positions(s), theta=1e4)
            x = x + self.o(rt.attention(q, k, self.v(h).view(b, s, 4, 8)))
            h = self.mlp_norm(x)
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

    model = Block()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(1, 8, 32, requires_grad=True)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).sum().backward()
        opt.step()

    return step


def _seconds(fn: Any, reps: int, clock: Any = time.perf_counter) -> float:
    start = clock()
    for _ in range(reps):
        fn()
    return (clock() - start) / reps


def _job(ctx: Any) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from meshllm_dsl.runtime.profile import LiveBytes

    rank, n = dist.get_rank(), ctx.n_ranks
    world = dist.new_group(list(range(n))) if n < ctx.world_size else None
    out: dict[str, float] = {}

    step = _mini_model()
    step()  # warm-up: optimizer state allocated
    with LiveBytes() as live:
        step()
    out["kernels"] = live.ops
    dist.barrier(group=world)
    if rank == 0:
        flops = []
        for size in (256, 512):
            a, b = torch.randn(size, size), torch.randn(size, size)
            a @ b  # warm-up
            flops.append(2 * size**3 / _seconds(lambda a=a, b=b: a @ b, max(3, int(2e8 / (2 * size**3))), time.process_time))
        out["flops"] = statistics.median(flops)
        # CPU time, not wall (the matmuls above too): what the work costs whatever else the
        # machine runs; how much of the machine the ranks get is `cores`.
        out["alone_s"] = statistics.median(_seconds(step, 10, time.process_time) for _ in range(5))

    # Every process at once, in 5 windows of 0.4 s: the median window discounts a burst of other
    # work on the machine.
    windows = []
    for _ in range(5):
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.4:
            step()
            done += 1
        windows.append((time.perf_counter() - start) / done)
    out["all_s"] = statistics.median(windows)
    pairs = [dist.new_group([i, i + 1]) for i in range(0, n - 1, 2)] if n > 1 else []  # collective
    dist.barrier(group=world)

    if n > 1 and rank < 2:
        pair = pairs[0]
        small, big = torch.ones(2), torch.ones(1 << 20)
        dist.all_reduce(small, group=pair)  # warm-up: connections made
        dist.all_reduce(big, group=pair)
        cpu, wall, wall_big = [], [], []
        for i in range(12):
            for _ in range(3):
                step()  # between kernels, as in a training step: gloo's threads go cold
            if rank == i % 2:
                c0 = time.process_time()
                dist.all_reduce(small, group=pair)
                cpu.append(time.process_time() - c0)
            else:
                # The peer comes late, as peers do when ranks time-share cores: the call sleeps
                # and is woken, which is most of what it costs a host.
                time.sleep(0.005)
                dist.all_reduce(small, group=pair)
            dist.barrier(group=pair)  # both arrive together: the wall time is the call's own
            w0 = time.perf_counter()
            dist.all_reduce(small, group=pair)
            wall.append(time.perf_counter() - w0)
        for _ in range(5):
            dist.barrier(group=pair)
            w0 = time.perf_counter()
            # [1M fp32]: timing only.
            dist.all_reduce(big, group=pair)
            wall_big.append(time.perf_counter() - w0)
        out.update(cpu_s=statistics.median(cpu), small_s=statistics.median(wall), big_s=statistics.median(wall_big))
    dist.barrier(group=world)
    return out


def calibrate(name: str, ranks: int) -> str:
    """The declaration text for this machine measured with ``ranks`` processes."""
    from meshllm_dsl.runtime.pool import WorkerPool

    with WorkerPool(world_size=ranks, timeout=600.0, preload=["torch", "torch.distributed"]) as pool:
        per_rank = pool.run(_job, ranks)
    first = per_rank[0]
    kernels = first["kernels"]
    kernel_us = first["alone_s"] / kernels * 1e6
    all_s = statistics.median(r["all_s"] for r in per_rank)
    # Every process running the loop at once gets through ranks x alone_s of CPU work in all_s of
    # wall time: that many cores' worth, fewer than the CPUs when other work shares the machine or
    # the processes evict each other's caches. Never more than the processes, nor the CPUs.
    share = ranks * first["alone_s"] / all_s
    cores = min(ranks, os.cpu_count() or ranks, share)
    tflops = first["flops"] / 1e12
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / ranks
    lines = [
        f"# Written by `meshc calibrate --device {name} --ranks {ranks}` on this machine "
        f"({os.cpu_count()} CPUs, gloo, 1 thread per process).",
        f"# One process alone: fp32 matmul {tflops * 1e3:.2f} GFLOP/s; a training step's kernels "
        f"{kernel_us:.1f} us of CPU each ({kernels} per mini step); {ranks} processes at once get "
        f"{share:.2f} cores' worth of work done.",
    ]
    settings = [f"memory = {mem_gib:.1f}", f"tflops = {tflops:.6f}", "mfu = 1", f"kernel = {kernel_us:.2f}",
                f"cores = {cores:.2f}", f"per_host = {max(64, ranks)}"]
    if ranks > 1:
        small, big, cpu = first["small_s"], first["big_s"], first["cpu_s"]
        gbps = 4 * (1 << 20) / max(big - small, 1e-9) / 1e9
        lines.append(f"# All-reduce between two processes: 8 bytes {small * 1e6:.0f} us "
                     f"({cpu * 1e6:.0f} us of CPU when waiting for a late peer), 4 MiB {big * 1e3:.1f} ms.")
        settings += [f"intra = {gbps:.3f}", f"inter = {gbps:.3f}", f"latency = {small * 1e6:.1f}",
                     f"collective_cpu = {cpu * 1e6:.1f}"]
    else:
        settings += ["intra = 1", "inter = 1"]  # one process: no collective is ever timed
    return "\n".join(lines) + f"\ndevice {name} {{\n" + "".join(f"    {x}\n" for x in settings) + "}\n"


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
