"""`meshc calibrate`: measure this machine and write a `device NAME { ... }` declaration.

Runs on a pool of gloo (CPU) worker processes, each with one thread as under torchrun. The matmul
rate is one rank's alone (the others wait at a barrier); host times are measured with all of them
running meshc's runtime together; `cores` says how much of the machine they get (other users'
work included, as it is when the job runs):

  tflops          dense fp32 matmul throughput per CPU second, median over sizes 256 and 512
  mfu             1: `tflops` is already what a matmul reaches, not a datasheet peak
  kernel          host CPU time per framework kernel (microseconds) of meshc's own runtime with every
                  process training at once, as in a job (time-sharing makes each kernel dearer: cold
                  caches after every wake-up): a tiny Llama and a tiny GPT-2 (2 blocks, hidden 64,
                  seq 32) over data x tensor, CPU time (all threads) less its collective calls,
                  over the kernels it dispatched (counted by runtime.profile.LiveBytes); the mean of
                  the two families' medians over the ranks
  collective_cpu  CPU time one collective call of that run costs its process (runtime.profile.CollectiveLog)
  stage_cpu       the same plan pipelined (1F1B over 2 stages): the host time beyond kernels and
                  collective calls, per stage forward or backward of a microbatch
  fsdp_cpu        the same plan with ZeRO-3 (FSDP2): that host time per unit all-gather or reduce-scatter
  cores           how many cores' worth of CPU time the processes get at once: their summed CPU time
                  over the wall time while all of them run a mini step (median of 5 windows of 0.4 s;
                  other users' work counts against it, as in a run)
  latency         median wall time of an 8-byte all-reduce between two processes (microseconds)
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

from meshllm_dsl.front.names import identifier_problem


def _mini_model() -> Any:
    """A Llama block at 8 tokens x 32 dims with its optimizer: the kernels of a training step."""
    import torch
    from torch import nn

    from meshllm_dsl.runtime.model import layers as rt

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


_CALIBRATION_SPEC = """
mesh m {{ axes {axes} }}
model l = {model}
plan p on m for l {{
    batch = {batch}
    seq = 32
    microbatches = 2
    layout {{ {layout} }}
    {extra}
}}
"""
# The two families' kernels cost different host time (GPT-2's layer norms, GELU, biases and learned
# positions measured about a fifth dearer per kernel than Llama's on tiny_gpt2 / tiny_llama shapes):
# `kernel` is the mean of the two, so neither family's steps are off by the whole difference.
_MODELS = {
    "llama": ("llama { vocab = 256, hidden = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 128, dtype = fp32 }",
              ["heads -> tensor", "kv_heads -> tensor", "ffn -> tensor", "vocab -> tensor"]),
    "gpt2": ("gpt2 { vocab = 256, hidden = 64, layers = 2, heads = 4, positions = 64, dtype = fp32 }",
             ["heads -> tensor", "ffn -> tensor", "vocab -> tensor"]),
}


def calibration_specs(ranks: int) -> dict[str, str]:
    """The plans whose runs price the runtime's host time on ``ranks`` processes: `base` and
    `base_gpt2` (kernels and collective calls), `pipeline` (the schedule's work per action), `fsdp`
    (FSDP2's per collective)."""
    tensor = 2 if ranks % 2 == 0 else 1
    data = ranks // tensor

    def spec(axes: list[str], extra: str = "", family: str = "llama") -> str:
        model, layout = _MODELS[family]
        d = next((int(a.split(" = ")[1]) for a in axes if a.startswith("data")), 1)
        lay = (["batch -> data"] if d > 1 else []) + (layout if any(a.startswith("tensor") for a in axes) else [])
        return _CALIBRATION_SPEC.format(axes=", ".join(axes), model=model, batch=8 * d, layout=", ".join(lay),
                                        extra=extra)

    t = [f"tensor = {tensor}"] if tensor > 1 else []
    specs = {"base": spec([f"data = {data}", *t]), "base_gpt2": spec([f"data = {data}", *t], family="gpt2")}
    if ranks % 2 == 0:
        specs["pipeline"] = spec(([f"data = {ranks // 2}"] if ranks > 2 else []) + ["pipeline = 2"],
                                 "stages over pipeline balanced\n    schedule 1f1b")
    if ranks > 1:
        zero3 = "optimizer adamw { zero 3 over data }"
        specs["fsdp"] = spec([f"data = {data}", *t], zero3) if data > 1 else spec([f"data = {ranks}"], zero3)
    return specs


def _render(specs: dict[str, str], directory: Path) -> dict[str, str]:
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.emit import render_plan

    paths = {}
    for name, text in specs.items():
        result = check_text(text, f"calibrate_{name}.mesh")
        if not result.ok:  # a bug here, not the user's: the specs are ours
            raise RuntimeError(f"calibration plan {name}: " + "; ".join(d.message for d in result.errors))
        (plan,) = result.plans.values()
        path = directory / f"calibrate_{name}.py"
        path.write_text(render_plan(plan, f"calibrate_{name}.mesh", text))
        paths[name] = str(path)
    return paths


def _runtime_host_time(ctx: Any, path: str, out_dir: str) -> dict[str, float]:
    """This rank's CPU time, kernels and collective calls per training step of a compiled plan, as
    `meshc run --profile` measures them (runtime.profile.profile_train)."""
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.runtime.train.profile import profile_train
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    # Warm-up, memory step, kernel count, then 5 timed steps.
    batches = [synthetic_batch(program.vocab, program.batch, program.seq, 0, i) for i in range(8)]
    report = profile_train(built, batches, out_dir)
    comm = report["collectives"]  # per step
    return {
        "cpu": report["cpu_s"], "kernels": report["kernels"],
        "calls": sum(c["calls"] for c in comm), "collective_cpu": sum(c["cpu_s"] for c in comm),
        "p2p_calls": sum(c["calls"] for c in comm if c["op"].endswith("(wait)")),
        "fsdp_calls": sum(c["calls"] for c in comm if c["op"].endswith("_single")),
    }


def _seconds(fn: Any, reps: int, clock: Any = time.perf_counter) -> float:
    start = clock()
    for _ in range(reps):
        fn()
    return (clock() - start) / reps


def _job(ctx: Any) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), ctx.n_ranks
    world = dist.new_group(list(range(n))) if n < ctx.world_size else None
    out: dict[str, float] = {}

    step = _mini_model()
    step()  # warm-up: optimizer state allocated
    dist.barrier(group=world)
    if rank == 0:
        flops = []
        for size in (256, 512):
            a, b = torch.randn(size, size), torch.randn(size, size)
            a @ b  # warm-up
            flops.append(2 * size**3 / _seconds(lambda a=a, b=b: a @ b, max(3, int(2e8 / (2 * size**3))), time.process_time))
        out["flops"] = statistics.median(flops)

    # Every process at once, in 5 windows of 0.4 s: the share of a core each gets (its CPU time
    # over the window); the median window discounts a burst of other work on the machine.
    shares = []
    for _ in range(5):
        start, cpu = time.perf_counter(), time.process_time()
        while time.perf_counter() - start < 0.4:
            step()
        shares.append((time.process_time() - cpu) / (time.perf_counter() - start))
    out["core_share"] = statistics.median(shares)
    pairs = [dist.new_group([i, i + 1]) for i in range(0, n - 1, 2)] if n > 1 else []  # collective
    dist.barrier(group=world)

    if n > 1 and rank < 2:
        pair = pairs[0]
        small, big = torch.ones(2), torch.ones(1 << 20)
        dist.all_reduce(small, group=pair)  # warm-up: connections made
        dist.all_reduce(big, group=pair)
        wall, wall_big = [], []
        for _ in range(12):
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
        out.update(small_s=statistics.median(wall), big_s=statistics.median(wall_big))
    dist.barrier(group=world)
    return out


def _host_costs(runs: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """`kernel`, `collective_cpu`, `stage_cpu` and `fsdp_cpu` (us) from the calibration plans' runs:
    what the planner's host-time model (planner/time.py) needs to reproduce each run's CPU time."""
    bases = [runs[k] for k in ("base", "base_gpt2") if k in runs]
    base = [r for runs_ in bases for r in runs_]
    calls = sum(r["calls"] for r in base)
    collective_us = 1e6 * sum(r["collective_cpu"] for r in base) / calls if calls else 0.0
    # Each family's median over the ranks of CPU time beyond collective calls, per kernel.
    per_family = [statistics.median(1e6 * (r["cpu"] - r["collective_cpu"]) / r["kernels"] for r in b) for b in bases]
    kernel_us = statistics.mean(per_family)
    out = {"kernel": kernel_us}
    if len(bases) == 2:  # for the declaration's comment: what each family measured
        out["kernel_llama"], out["kernel_gpt2"] = per_family
    if calls:
        out["collective_cpu"] = collective_us

    def beyond(r: dict[str, float], charged_calls: float) -> float:
        """Host time (us) beyond the kernels and collective calls the planner charges for."""
        return 1e6 * r["cpu"] - r["kernels"] * kernel_us - charged_calls * collective_us

    if "pipeline" in runs:
        # Two stages, 2 microbatches: 4 actions per rank; the planner charges one send / recv call per
        # microbatch (one neighbour) and the other collectives as measured.
        out["stage_cpu"] = max(0.0, statistics.median(
            beyond(r, r["calls"] - r["p2p_calls"] + 2) / 4 for r in runs["pipeline"]))
    if "fsdp" in runs:
        out["fsdp_cpu"] = max(0.0, statistics.median(
            beyond(r, r["calls"]) / r["fsdp_calls"] for r in runs["fsdp"] if r["fsdp_calls"]))
    return out


def calibrate(name: str, ranks: int) -> str:
    """The declaration text for this machine measured with ``ranks`` processes."""
    import tempfile

    from meshllm_dsl.runtime.jobs.pool import WorkerPool

    with tempfile.TemporaryDirectory() as tmp:
        paths = _render(calibration_specs(ranks), Path(tmp))
        with WorkerPool(world_size=ranks, timeout=600.0, preload=["torch", "torch.distributed"]) as pool:
            per_rank = pool.run(_job, ranks)
            runs = {k: pool.run(_runtime_host_time, ranks, path, str(Path(tmp) / k)) for k, path in paths.items()}
    first = per_rank[0]
    host = _host_costs(runs)
    # Never more than the processes, nor the CPUs.
    share = sum(r["core_share"] for r in per_rank)
    cores = min(ranks, os.cpu_count() or ranks, share)
    tflops = first["flops"] / 1e12
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / ranks
    lines = [
        f"# Written by `meshc calibrate --device {name} --ranks {ranks}` on this machine "
        f"({os.cpu_count()} CPUs, gloo, 1 thread per process).",
        f"# One process alone: fp32 matmul {tflops * 1e3:.2f} GFLOP/s. {ranks} process{'es' if ranks > 1 else ''} at once get "
        f"{share:.2f} cores' worth of CPU time; running meshc's runtime together, each kernel costs "
        f"{host['kernel']:.1f} us of CPU"
        + (f" (Llama {host['kernel_llama']:.1f}, GPT-2 {host['kernel_gpt2']:.1f})" if "kernel_gpt2" in host else "")
        + (f", each collective call {host['collective_cpu']:.0f} us" if "collective_cpu" in host else "") + ".",
    ]
    settings = [f"memory = {mem_gib:.1f}", f"tflops = {tflops:.6f}", "mfu = 1", f"kernel = {host['kernel']:.2f}",
                f"cores = {cores:.2f}", f"per_host = {max(64, ranks)}"]
    if ranks > 1:
        small, big = first["small_s"], first["big_s"]
        gbps = 4 * (1 << 20) / max(big - small, 1e-9) / 1e9
        lines.append(f"# All-reduce between two processes: 8 bytes {small * 1e6:.0f} us, 4 MiB {big * 1e3:.1f} ms.")
        settings += [f"intra = {gbps:.3f}", f"inter = {gbps:.3f}", f"latency = {small * 1e6:.1f}"]
        # Settings are positive: a cost too small to measure is written as 0.01 us.
        settings += [f"{k} = {max(host[k], 0.01):.2f}" for k in ("collective_cpu", "stage_cpu", "fsdp_cpu") if k in host]
    else:
        settings += ["intra = 1", "inter = 1"]  # one process: no collective is ever timed
    return "\n".join(lines) + f"\ndevice {name} {{\n" + "".join(f"    {x}\n" for x in settings) + "}\n"


def cmd_calibrate(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli.main import UsageError

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
