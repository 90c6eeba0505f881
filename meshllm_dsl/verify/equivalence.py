"""`meshc verify`: run a plan's tiny twin sharded on CPU processes and unsharded in one, compare.

The comparison covers the forward logits, the loss, every parameter gradient (gathered back to full
shape) and every parameter after one AdamW step. float64 by default, where agreement to 1e-10 is
expected; any larger difference is a bug in the plan's lowering or the runtime, not rounding.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshllm_dsl.progress import StatusLine

if TYPE_CHECKING:
    from meshllm_dsl.checker import CheckResult


class TwinError(Exception):
    """A twin asked for (``--microbatches``) that does not check; one line."""


def load_generated(path: str) -> Any:
    """Import a generated module from its file (each rank of a job imports it itself).

    Named after its contents, so a long-lived worker that sees the same plan again reuses the
    module and one that sees a different plan under the same file name does not.
    """
    text = Path(path).read_bytes()
    name = "meshc_generated_" + hashlib.sha256(text).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The pool's timeout (each collective's, and the whole comparison's) grows with the ranks: on a
# 2-core machine 64 ranks take minutes where 8 take seconds (measured: ~6 minutes for 64 before
# the comparison was sped up).
TIMEOUT_BASE_S = 120.0
TIMEOUT_PER_RANK_S = 10.0
MIN_TIMEOUT_S = 300.0
TIMINGS_ENV = "MESHC_VERIFY_TIMINGS"  # set: print where the time went on stderr


def pool_timeout(ranks: int) -> float:
    """Seconds the pool of ``ranks`` processes may take: a base plus per-rank seconds, at least 300."""
    return max(MIN_TIMEOUT_S, TIMEOUT_BASE_S + TIMEOUT_PER_RANK_S * ranks)


def compare_job(ctx: Any, path: str, dtype_name: str, seed: int) -> tuple[dict[str, float], float, dict[str, float]]:
    """One rank's part of the comparison: max |sharded - reference| per tensor as this rank sees
    it (every rank gathers the full tensors and runs the reference), the dtype's tolerance, and
    when (wall clock) it started, had its process groups and ended."""
    import torch

    from meshllm_dsl.runtime.jobs.compare import TOLERANCE, compare_to_reference

    t0 = time.time()
    program = load_generated(path).PROGRAM
    mesh = ctx.mesh(program.axes)
    t1 = time.time()
    if os.environ.get("MESHC_VERIFY_PROFILE"):  # a directory: each rank's cProfile of the comparison
        import cProfile

        prof = cProfile.Profile()
        errs = prof.runcall(compare_to_reference, program, mesh, dtype=getattr(torch, dtype_name), seed=seed)
        prof.dump_stats(f"{os.environ['MESHC_VERIFY_PROFILE']}/rank{ctx.rank}.prof")
    else:
        errs = compare_to_reference(program, mesh, dtype=getattr(torch, dtype_name), seed=seed)
    # The tolerance travels back with the errors so the parent never imports torch.
    return errs, TOLERANCE[dtype_name], {"start": t0, "groups": t1, "end": time.time()}


def _print_timings(t_begin: float, t_twin: float, pool: dict[str, float], ranks: list[dict[str, float]]) -> None:
    """Where the time of a verify went (MESHC_VERIFY_TIMINGS=1), on stderr."""
    wall = time.time() - time.monotonic()  # monotonic -> wall clock, for the ranks' stamps
    start, groups, end = (min(r["start"] for r in ranks), max(r["groups"] for r in ranks),
                          max(r["end"] for r in ranks))
    rows = [
        ("twin checked and rendered", t_twin - t_begin),
        ("fork server up (imports torch), processes forked", pool["forked"] - pool["start"]),
        ("process group joined (init_process_group)", pool["ready"] - pool["forked"]),
        ("job sent -> first rank starts it", start - (pool["job start"] + wall)),
        ("process groups created (Mesh.build)", groups - start),
        ("built, run and compared (slowest rank)", end - groups),
        ("first rank done -> last rank done", pool["job end"] - pool["job first"]),
        ("total", time.monotonic() - t_begin),
    ]
    for what, took in rows:
        print(f"meshc verify: {took:8.1f} s  {what}", file=sys.stderr)


def _worst(a: float, b: float) -> float:
    """The larger difference, NaN counting as the largest."""
    return a if a != a or (b == b and a > b) else b


def verify(
    path: str,
    plan_name: str | None,
    dtype_name: str = "float64",
    seed: int = 0,
    result: CheckResult | None = None,
    status: StatusLine | None = None,
    timeout: float | None = None,
    microbatches: int | None = None,
) -> tuple[str, bool]:
    """Report text and verdict for the tiny twin of a plan. Raises SpecError-free: caller checks.

    ``result``: the file's check result when the caller already has it. ``status``: where to say
    what it is doing (default: a line on stderr while it is a terminal). ``timeout``: seconds the
    ranks may take to start, and then to compare (default ``pool_timeout`` of the mesh size).
    ``microbatches``: the twin's, instead of the plan's (``TwinError`` if the twin then does not check).
    """
    from meshllm_dsl.codegen.emit import render_plan
    from meshllm_dsl.runtime.jobs.pool import WorkerPool
    from meshllm_dsl.verify.twin import make_twin, twin_values

    if result is None:
        from meshllm_dsl.checker import check_file

        result = check_file(path)
    name = plan_name or sorted(result.plans)[0]
    plan = result.plans[name]
    # Import in the fork server, once, what every worker's job imports (the twin keeps the plan's
    # mesh, stage map and optimizer): torch._dynamo, which constructing any torch optimizer imports
    # (about 1.3 CPU-s; the 8 workers of a plan would each pay it), ZeRO's optimizer, and pipelining
    # (DTensor) only when the plan uses them.
    preload = ["torch", "torch.distributed", "torch._dynamo", "meshllm_dsl.runtime.jobs.compare"]
    if plan.roles.pipeline and plan.pipeline_size > 1:
        preload.append("torch.distributed.pipelining")
    if plan.zero:
        preload.append("torch.distributed.optim")
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is None and "meshllm_dsl.cli.main" in sys.modules:
        # Run as the `meshc` script: multiprocessing re-runs a script __main__ in every worker
        # (Python 3.11's fork server ignores "__main__" in its preload). Importing the CLI once
        # in the server makes those re-runs find it loaded, instead of 8 imports of the front end.
        preload.append("meshllm_dsl.cli.main")
    import tempfile

    n = plan.mesh.devices
    limit = pool_timeout(n) if timeout is None else timeout
    t_begin = time.monotonic()
    with status or StatusLine("meshc verify") as line, tempfile.TemporaryDirectory(prefix="meshc-verify-") as tmp, \
            WorkerPool(world_size=n, timeout=limit, start_timeout=limit, preload=preload) as pool:
        comparing = f"comparing the twin sharded on {n} processes with it unsharded (logits, gradients, one step)"

        def report(phase: str, done: int, of: int) -> None:
            if phase == "ready":
                line.update(f"starting {n} processes: {done} of {of} in the process group")
            else:
                line.update(f"{comparing}: {done} of {of} ranks done")

        pool.on_report = report
        # The server imports torch (seconds) while this process builds and renders the twin.
        line.update(f"starting {n} processes, building the tiny twin")
        pool.prestart()
        twin_text, twin_result = make_twin(result, name, path, microbatches)
        if not twin_result.ok and microbatches is not None:
            first = next(iter(twin_result.errors))
            raise TwinError(f"--microbatches {microbatches}: the tiny twin does not check: {first.message} [{first.code}]")
        if not twin_result.ok:
            from meshllm_dsl.diagnostics import render_all

            raise RuntimeError("the tiny twin does not check:\n" + render_all(twin_result.diagnostics) + twin_text)
        twin = twin_result.plans[name]
        module = Path(tmp) / f"{name}_twin.py"
        module.write_text(render_plan(twin, f"{path} (tiny twin)", twin_text))
        t_twin = time.monotonic()
        line.update(f"starting {n} processes")
        per_rank = pool.run(compare_job, twin.mesh.devices, str(module), dtype_name, seed)
    if os.environ.get(TIMINGS_ENV):
        _print_timings(t_begin, t_twin, pool.timings, [r[2] for r in per_rank])
    # Every rank's view counts: a replica whose gathered copy differs is a bug rank 0 cannot see.
    tol = per_rank[0][1]
    errs = dict(per_rank[0][0])
    for rank_errs, *_ in per_rank[1:]:
        for k, v in rank_errs.items():
            errs[k] = _worst(errs[k], v)
    worst = sorted(errs.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else float("-inf"))
    bad = [(k, v) for k, v in errs.items() if not v <= tol]
    values = twin_values(plan)
    lines = [
        f"plan `{name}` of {path}: mesh {' x '.join(f'{a.name} {a.size}' for a in plan.mesh.axes)}"
        f" ({plan.mesh.devices} processes), "
        + (f"schedule {twin.schedule}, {len(twin.stages)} stages" if len(twin.stages) > 1 else "no pipeline"),
        "tiny twin: " + ", ".join(f"{k} {dict(plan.model.values)[k]} -> {v}" for k, v in values.items())
        + f"; batch {plan.batch} -> {twin.batch}, seq {plan.seq} -> {twin.seq}"
        + (f", microbatches {plan.microbatches} -> {twin.microbatches}" if twin.microbatches != plan.microbatches else "")
        + f" ({twin.model.numel:,} parameters)",
        f"compared in {dtype_name} (tolerance {tol:g}) on all {len(per_rank)} ranks: logits, loss, {sum(k.startswith('grad ') for k in errs)} gradients,"
        f" {sum(k.startswith('param') for k in errs)} parameters after one AdamW step",
        *([("on packed batches: random document boundaries in every row, attention masked at them"
            + (", positions restarting at each" if twin.restart_positions else "")
            + (f", each row spread over the context ranks by its documents (`{twin.context_balance}`)"
               if twin.context_balance != "headtail" else "")
            + ", some targets ignored; the unsharded model runs each document alone")] if twin.document_mask else []),
        "",
        f"{'tensor':<44} {'max |sharded - unsharded|':>26}",
    ]
    for k, v in worst[:12]:
        lines.append(f"{k:<44} {v:>26.3e}{'  <-- differs' if not v <= tol else ''}")
    if len(worst) > 12:
        lines.append(f"... {len(worst) - 12} more, all smaller")
    if plan.float8 is not None or plan.compile != "none":
        off = " and ".join(x for x in ("float8 matmuls" if plan.float8 is not None else "",
                                        "compiled blocks" if plan.compile != "none" else "") if x)
        lines.append(f"{off}: off in this comparison, which checks the sharding exactly "
                     "(float8 rounds by design; `meshc run` trains with them)")
    lines.append("")
    lines.append("verdict: EQUAL" if not bad else f"verdict: DIFFERS ({len(bad)} tensors over tolerance)")
    return "\n".join(lines) + "\n", not bad
