"""`meshc compile` and `meshc run`: code generation and launching (imports torch only to run)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from meshllm_dsl.diagnostics import render_all


def _checked(path: str, plan_name: str | None = None):  # type: ignore[no-untyped-def]
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.cli import existing, select_plans

    result = check_file(existing(path)[0])
    if result.diagnostics:
        print(render_all(result.diagnostics), end="", file=sys.stderr)
    if not result.ok:
        return result, None
    return result, select_plans(result.plans, path, plan_name)[0]


def cmd_compile(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli import UsageError
    from meshllm_dsl.codegen.emit import render_package
    from meshllm_dsl.outputs import OutputError, write_generated

    result, _ = _checked(args.file, args.plan)
    if not result.ok:
        return 1
    files = render_package(result, args.file)
    if args.plan:
        files = {k: v for k, v in files.items() if k in (f"{args.plan}.py", "__init__.py")}
    try:
        # With --plan the other plans' files of an earlier run stay (they are still meshc's).
        written = write_generated(files, args.output, force=args.force, protect=result.sources, prune=not args.plan)
    except OutputError as err:
        raise UsageError(str(err)) from None
    for path in written:
        print(f"wrote {path}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from meshllm_dsl.codegen.emit import render_package
    from meshllm_dsl.outputs import write_generated

    result, plan_name = _checked(args.file, args.plan)
    if not result.ok:
        return 1
    plan = result.plans[plan_name]
    nproc = args.nproc or plan.mesh.devices
    if nproc != plan.mesh.devices:
        from meshllm_dsl.cli import UsageError

        raise UsageError(f"plan `{plan_name}` needs {plan.mesh.devices} processes (its mesh size), not {nproc}")
    workdir = Path(tempfile.mkdtemp(prefix="meshc-run-"))
    try:
        write_generated(render_package(result, args.file), workdir / "generated")
        script = workdir / "generated" / f"{plan_name}.py"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script), "--steps", str(args.steps), "--seed", str(args.seed),
        ]
        if args.data:
            cmd += ["--data", args.data]
        if args.infer:
            cmd += ["--infer", "--tokens", str(args.tokens)]
        if args.profile is not None:
            cmd += ["--profile", str(workdir / "profile")]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("LOGLEVEL", "WARNING")
        print(f"meshc: launching {nproc} processes for plan `{plan_name}`", file=sys.stderr)
        proc = subprocess.run(cmd, env=env, check=False)
        if proc.returncode == 0 and args.profile is not None:
            _print_profile(plan, args.file, workdir / "profile", args.profile)
        return 0 if proc.returncode == 0 else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _print_profile(plan: Any, spec: str, directory: Path, json_path: str) -> None:
    from meshllm_dsl.cli_plan import load_checked
    from meshllm_dsl.planner import analyze, resolve_device
    from meshllm_dsl.profile_report import compare, read_ranks, report_text

    # The spec's own `device` declarations (e.g. from `meshc calibrate`) count, as in `meshc plan`.
    device, assumed = resolve_device(plan, load_checked(spec).devices)
    data = compare(plan, read_ranks(directory), analyze(plan, device, device_assumed=assumed))
    print(report_text(data), end="")
    if json_path:
        Path(json_path).write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {json_path}")


def cmd_verify(args: argparse.Namespace) -> int:
    from meshllm_dsl.verify import verify

    result, plan_name = _checked(args.file, args.plan)
    if not result.ok:
        return 1
    report, equal = verify(args.file, plan_name, args.dtype, args.seed)
    print(report, end="")
    return 0 if equal else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = sub.add_parser("compile", help="write the generated torch.distributed package")
    c.add_argument("file", metavar="FILE")
    c.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="the package directory: created if missing; refused if it holds files meshc did not write")
    c.add_argument("--force", action="store_true",
                   help="write into a directory meshc did not create, replacing files of the names it writes "
                        "(never deleting anything else)")
    c.add_argument("--plan", help="only this plan (default: every plan in the file)")
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="compile and launch with torchrun on this machine")
    r.add_argument("file", metavar="FILE")
    r.add_argument("--plan", help="which plan (default: the first by name)")
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--nproc", type=int, help="processes (default and only valid value: the mesh size)")
    r.add_argument("--data", metavar="TEXTFILE", help="train on this text (bytes -> tokens) instead of synthetic tokens")
    r.add_argument("--infer", action="store_true", help="greedy generation instead of training")
    r.add_argument("--tokens", type=int, default=16, help="tokens to generate with --infer")
    r.add_argument("--profile", nargs="?", const="", metavar="JSON",
                   help="after training, measure 3 more steps per rank and print them next to `meshc plan` "
                        "(memory by category, compute, collectives per mesh axis, pipeline waits); JSON: also write them there")
    r.set_defaults(func=cmd_run)

    v = sub.add_parser("verify", help="tiny-twin equivalence: sharded vs unsharded outputs and gradients on CPU")
    v.add_argument("file", metavar="FILE")
    v.add_argument("--plan", help="which plan (default: the first by name)")
    v.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    v.add_argument("--seed", type=int, default=0)
    v.set_defaults(func=cmd_verify)
