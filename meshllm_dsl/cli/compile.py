"""`meshc compile` and `meshc run`: code generation and launching (imports torch only to run)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from meshllm_dsl.diagnostics import render_all
from meshllm_dsl.runtime.train.profile_steps import PROFILE_STEPS_TEXT, TRACE_STEPS_TEXT


def _checked(path: str, plan_name: str | None = None):  # type: ignore[no-untyped-def]
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.cli.main import existing, select_plans

    result = check_file(existing(path)[0])
    if result.diagnostics:
        print(render_all(result.diagnostics), end="", file=sys.stderr)
    if not result.ok:
        return result, None
    return result, select_plans(result.plans, path, plan_name)[0]


def cmd_compile(args: argparse.Namespace) -> int:
    from meshllm_dsl.codegen.emit import render_package
    from meshllm_dsl.runtime.outputs import write_generated

    if args.slurm:
        from meshllm_dsl.cli.main import UsageError
        from meshllm_dsl.codegen.slurm import check_script_values

        try:  # before the spec is read: a name the script cannot hold is refused whatever the spec says
            check_script_values(args.output, args.file)
        except ValueError as err:
            raise UsageError(str(err)) from None
    result, _ = _checked(args.file, args.plan)
    if not result.ok:
        return 1
    files = render_package(result, args.file)
    if args.slurm:
        from meshllm_dsl.codegen.slurm import sbatch_script

        # Through the same manifest as the package: replaced only while meshc's own.
        for name, plan in result.plans.items():
            files[f"{name}.sbatch"] = sbatch_script(plan, args.output, args.file, result.profiles)
    if args.plan:
        files = {k: v for k, v in files.items() if k in (f"{args.plan}.py", f"{args.plan}.sbatch", "__init__.py")}
    # With --plan the other plans' files of an earlier run stay (they are still meshc's).
    written = write_generated(files, args.output, force=args.force, protect=result.sources, prune=not args.plan)
    for path in written:
        print(f"wrote {path}")
    return 0


def _run_inputs(args: argparse.Namespace, seq: int, plan: Any = None) -> list[str]:
    """The flags passed to every rank, after the checks that need no rank (UsageError if bad)."""
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.codegen.lower import model_description
    from meshllm_dsl.runtime.train import launch

    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.max_restarts and not args.save:
        raise UsageError("--max-restarts needs --save DIR: a restart resumes from its latest checkpoint")
    from meshllm_dsl.cli.data import run_data

    flags = ["--steps", str(args.steps), "--seed", str(args.seed), "--timeout", f"{args.timeout:g}"]
    data = run_data(args, documents=plan is not None and plan.document_mask)
    if data:
        flags += ["--data", data]
    if args.balance:
        flags += ["--balance"]
    if args.infer:
        flags += ["--infer", "--tokens", str(args.tokens)]
    flags += ["--save-every", str(args.save_every), "--keep", str(args.keep)]
    if args.save:
        flags += ["--save", args.save]
    if args.save_over:
        flags += ["--save-over"]
    if args.weights_extra != "error":
        flags += ["--weights-extra", args.weights_extra]
    if args.resume:
        flags += ["--resume", args.resume]
    if args.load:
        flags += ["--load", args.load]
    if args.debug:
        flags += ["--debug"]
    if args.profile_trace is not None:
        flags += ["--profile-trace", str(Path(args.profile_trace).resolve())]
    if args.metrics is not None:
        flags += ["--metrics", str(Path(args.metrics).resolve())]
    if args.tensorboard is not None:
        flags += ["--tensorboard", str(Path(args.tensorboard).resolve())]
    flags += _hf_flags(args)
    # --profile's directory is made per run; any path stands in for it to check the flags.
    ns = launch.parse_args(flags + (["--profile", "profile"] if args.profile is not None else []))
    try:
        launch.check_inputs(ns, model_description(plan) if plan is not None else None, seq)
    except launch.InputError as err:
        raise UsageError(str(err)) from None
    if plan is not None and plan.document_mask and data and not args.infer and not launch.is_corpus(Path(data)):
        # The windows of a text or byte file cross document boundaries the mask cannot see.
        raise UsageError(f"--data {data}: `pack = documents` in plan `{plan.name}` trains on documents; this file "
                         "is read as windows of text or bytes that cross them. Pass --tokenizer DIR with a source "
                         "it tokenizes into documents (JSONL, Parquet, a saved dataset), or `meshc tokenize` the text first")
    if data and not args.infer and Path(data).is_file() and Path(data).stat().st_size < seq + 2:
        raise UsageError(f"--data {data}: needs at least {seq + 2} bytes for seq {seq}, has {Path(data).stat().st_size}")
    return flags


def cmd_run(args: argparse.Namespace) -> int:
    from meshllm_dsl.codegen.emit import render_package
    from meshllm_dsl.runtime.outputs import write_generated

    result, plan_name = _checked(args.file, args.plan)
    if not result.ok:
        return 1
    plan = result.plans[plan_name]
    nodes = _nodes(args, plan_name, plan.mesh)
    nproc = args.nproc or plan.mesh.devices // nodes
    if nproc * nodes != plan.mesh.devices:
        from meshllm_dsl.cli.main import UsageError

        per = f" per node ({plan.mesh.devices} over {nodes} nodes)" if nodes > 1 else " (its mesh size)"
        raise UsageError(f"plan `{plan_name}` needs {plan.mesh.devices // nodes} processes{per}, not {nproc}")
    flags = _run_inputs(args, plan.seq, plan)
    if plan.float8 is not None:
        # Here, once, rather than in every rank it would launch (each would stop with the same line).
        from meshllm_dsl.cli.main import UsageError
        from meshllm_dsl.runtime.train.float8 import Float8Unavailable, torchao_version

        try:
            torchao_version()
        except Float8Unavailable as err:
            raise UsageError(str(err)) from None
    workdir = Path(tempfile.mkdtemp(prefix="meshc-run-"))
    try:
        write_generated(render_package(result, args.file), workdir / "generated")
        script = workdir / "generated" / f"{plan_name}.py"
        if args.weights:
            _check_weights(args, script)
        if nodes > 1:
            # torchrun's own c10d rendezvous: every node runs this same command; the node that
            # owns the endpoint hosts the store.  A node that never arrives ends the others after
            # --timeout (join_timeout), not torchrun's default 600 s.
            where = [
                f"--nnodes={nodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id or 'meshc-' + plan_name}",
                f"--rdzv-conf=join_timeout={args.timeout:g}",
            ]
        else:
            where = ["--standalone"]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
            f"--max-restarts={args.max_restarts}", str(script), *flags,
        ]
        if args.profile is not None:
            cmd += ["--profile", str(workdir / "profile")]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("LOGLEVEL", "WARNING")
        # Rank 0's output reaches this process's stderr through a pipe: the bar only on a terminal.
        from meshllm_dsl.runtime.train.launch import TTY_ENV

        env.setdefault(TTY_ENV, "1" if _isatty(sys.stderr) else "0")
        if plan.mesh.device == "cpu":
            env.setdefault("MESHLLM_DEVICE", "cpu")  # the spec says CPUs: gloo even where CUDA is present
        if args.max_restarts:
            # torch shares the rendezvous store with the workers by default, and a restarted
            # worker then reads its peers' addresses from the previous attempt (pytorch#135712).
            env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        on = f" on this node, one of {nodes} (rendezvous {args.rdzv_endpoint})" if nodes > 1 else ""
        print(f"meshc: launching {nproc} processes for plan `{plan_name}`{on}", file=sys.stderr)
        from meshllm_dsl.cli.job import run_job

        code = run_job(cmd, env, marker=str(workdir), debug=args.debug,
                       rendezvous=(args.rdzv_endpoint, nodes, args.timeout) if nodes > 1 else None)
        if code == 0 and args.profile is not None:
            _print_profile(plan, args.file, workdir / "profile", args.profile)
        return code
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _check_weights(args: argparse.Namespace, script: Path) -> None:
    """--weights against the generated program (config, index, tensor headers), before launching."""
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.runtime.hf.weights import WeightsError, check_weights
    from meshllm_dsl.verify.equivalence import load_generated

    try:
        check_weights(args.weights, load_generated(str(script)).PROGRAM, args.weights_extra)
    except WeightsError as err:
        raise UsageError(f"bad --weights: {err}") from None


def _nodes(args: argparse.Namespace, plan_name: str, mesh: Any) -> int:
    """How many nodes the job spans (1 without --nnodes); UsageError for flags that disagree with
    each other or with the mesh's `hosts`, before anything starts on any node."""
    from meshllm_dsl.cli.main import UsageError

    multi = [f for f, v in (("--node-rank", args.node_rank), ("--rdzv-endpoint", args.rdzv_endpoint),
                            ("--rdzv-id", args.rdzv_id)) if v is not None]
    if args.nnodes is None:
        if multi:
            raise UsageError(f"{multi[0]} needs --nnodes N (the job's node count)")
        return 1
    nodes = args.nnodes
    if nodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {nodes}")
    if nodes != mesh.hosts:
        declared = f"declares `hosts = {mesh.hosts}`" if mesh.hosts > 1 else "declares no `hosts` (one node)"
        raise UsageError(f"--nnodes {nodes} disagrees with the spec: mesh `{mesh.name}` of plan `{plan_name}` "
                         f"{declared}; run on {mesh.hosts} node{'s' * (mesh.hosts > 1)} or set `hosts = {nodes}`")
    if nodes == 1:
        return 1
    if args.rdzv_endpoint is None:
        raise UsageError("--nnodes needs --rdzv-endpoint HOST:PORT (the first node's address)")
    # As in torchrun's c10d rendezvous, --node-rank is checked but not binding: the rendezvous
    # numbers the nodes, and every node's ranks are a contiguous block of the mesh's rank order.
    if args.node_rank is not None and not 0 <= args.node_rank < nodes:
        raise UsageError(f"--node-rank must be 0 to {nodes - 1} for {nodes} nodes, got {args.node_rank}")
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint}: expected HOST:PORT, e.g. node001:29500")
    if args.profile is not None:
        raise UsageError("--profile reads every rank's measurements on this machine: it runs on one node only")
    return nodes


def _hf_flags(args: argparse.Namespace) -> list[str]:
    """Real-model flags passed through to the generated module (paths made absolute)."""
    out: list[str] = []
    for flag in ("weights", "export_hf", "tokenizer"):
        value = getattr(args, flag, None)
        if value:
            out += ["--" + flag.replace("_", "-"), str(Path(value).resolve())]
    for flag in ("prompt", "prompt_ids"):
        value = getattr(args, flag, None)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), value]
    if getattr(args, "eval", False):
        out.append("--eval")
    return out


def _print_profile(plan: Any, spec: str, directory: Path, json_path: str) -> None:
    from meshllm_dsl.cli.plan import load_checked
    from meshllm_dsl.planner.analyze import analyze, resolve_device
    from meshllm_dsl.views.profile_report import compare, read_ranks, report_text

    # The spec's own `device` declarations (e.g. from `meshc calibrate`) count, as in `meshc plan`.
    device, assumed = resolve_device(plan, load_checked(spec).devices)
    data = compare(plan, read_ranks(directory), analyze(plan, device, device_assumed=assumed))
    print(report_text(data), end="")
    if json_path:
        Path(json_path).write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {json_path}")


def cmd_verify(args: argparse.Namespace) -> int:
    from meshllm_dsl.verify.equivalence import verify

    if args.timeout is not None and not 0 < args.timeout <= 1e7:  # nan and inf too
        from meshllm_dsl.cli.main import UsageError

        raise UsageError(f"--timeout must be positive seconds, at most 1e+07, got {args.timeout:g}")
    if args.microbatches is not None and args.microbatches < 1:
        from meshllm_dsl.cli.main import UsageError

        raise UsageError(f"--microbatches must be at least 1, got {args.microbatches}")
    result, plan_name = _checked(args.file, args.plan)
    if not result.ok:
        return 1
    from meshllm_dsl.runtime.jobs.pool import PoolError
    from meshllm_dsl.verify.equivalence import TwinError

    try:
        report, equal = verify(args.file, plan_name, args.dtype, args.seed, result, timeout=args.timeout,
                               microbatches=args.microbatches)
    except TwinError as err:
        from meshllm_dsl.cli.main import UsageError

        raise UsageError(str(err)) from None
    except PoolError as err:
        text = str(err)
        if "timed out" not in text:
            raise
        from meshllm_dsl.cli.main import UsageError

        raise UsageError(f"verify: the {text} (a larger --timeout SECONDS gives the processes longer)") from None
    print(report, end="")
    return 0 if equal else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from meshllm_dsl.cli.data import add_run_data_flags

    c = sub.add_parser("compile", help="write the generated torch.distributed package")
    c.add_argument("file", metavar="FILE")
    c.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="the package directory: created if missing; refused if it holds files meshc did not write")
    c.add_argument("--force", action="store_true",
                   help="write into a directory meshc did not create, replacing files of the names it writes "
                        "(never deleting anything else)")
    c.add_argument("--plan", help="only this plan (default: every plan in the file)")
    c.add_argument("--slurm", action="store_true",
                   help="also write PLAN.sbatch per plan: nodes from `hosts`, srun torchrun with the rendezvous on the first node")
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="compile and launch with torchrun (this machine, or --nnodes N nodes)")
    r.add_argument("file", metavar="FILE")
    r.add_argument("--plan", help="which plan (default: the first by name)")
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--nproc", type=int, help="processes on this node (default and only valid value: the mesh size / nodes)")
    r.add_argument("--nnodes", type=int, metavar="N",
                   help="nodes of the job (must equal the mesh's `hosts`); every node runs the same command")
    r.add_argument("--node-rank", type=int, metavar="R", help="with --nnodes: this node's number, 0 to N-1 (checked; as in torchrun's c10d "
                        "rendezvous, the rendezvous decides which block of ranks each node gets)")
    r.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="with --nnodes: torchrun's c10d rendezvous, on the first node (e.g. node001:29500)")
    r.add_argument("--rdzv-id", metavar="ID", help="with --nnodes: the job id at the rendezvous (default meshc-PLAN)")
    r.add_argument("--data", metavar="SPEC",
                   help="train on these documents instead of synthetic tokens: a token file, JSONL / Parquet files or "
                        "directories, a saved `datasets` directory, text (with --tokenizer), several as a.jsonl:0.7,b.parquet:0.3 "
                        "(docs/guides/data.md); a file without --tokenizer is read as bytes")
    add_run_data_flags(r)
    r.add_argument("--balance", action="store_true",
                   help="with a token-file --data: repack each step's documents so the data ranks' attention work evens out")
    r.add_argument("--infer", action="store_true", help="greedy generation instead of training")
    r.add_argument("--tokens", type=int, default=16, help="tokens to generate with --infer")
    r.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds a rank may wait for a peer before the job stops (default 300)")
    r.add_argument("--save", metavar="DIR", help="checkpoint root: DIR/step-NNNNNN (atomic), DIR/latest")
    r.add_argument("--save-every", type=int, default=0, metavar="N", help="also checkpoint every N steps (default: only at the end)")
    r.add_argument("--keep", type=int, default=3, metavar="K", help="keep the newest K checkpoints (default 3)")
    r.add_argument("--resume", metavar="DIR|latest", help="continue from a checkpoint (whole training state) up to --steps in total")
    r.add_argument("--save-over", action="store_true",
                   help="let this run write into a --save root holding another run's checkpoints (never "
                        "pruned; replaced only at the steps this run saves; `latest` then names this run's)")
    r.add_argument("--load", metavar="DIR", help="start from the weights of a checkpoint (any layout), at step 0")
    r.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart the job up to N times after a failure, resuming from the latest --save checkpoint")
    r.add_argument("--debug", action="store_true", help="full tracebacks and launcher output on failures")
    r.add_argument("--weights", metavar="DIR", help="start from a Hugging Face model directory (safetensors)")
    r.add_argument("--export-hf", metavar="DIR", help="write a Hugging Face model directory at the end "
                   "(a new or empty directory, or one meshc exported to before)")
    r.add_argument("--weights-extra", choices=("error", "ignore"), default="error",
                   help="tensors of --weights the model has no place for: an error (default), or ignored with a warning")
    r.add_argument("--tokenizer", metavar="DIR", help="a Hugging Face tokenizer: --data is text, --prompt is decoded")
    r.add_argument("--prompt", metavar="TEXT", help="with --infer: the prompt text (needs --tokenizer)")
    r.add_argument("--prompt-ids", metavar="IDS", help="with --infer: the prompt as token ids, e.g. 1,2,3")
    r.add_argument("--eval", action="store_true", help="report mean loss and perplexity on --data without training")
    r.add_argument("--profile", nargs="?", const="", metavar="JSON",
                   help=f"after training, measure {PROFILE_STEPS_TEXT} on every rank and print them next to `meshc plan` "
                        "(memory by category, compute, collectives per mesh axis, pipeline waits); JSON: also write them there")
    r.add_argument("--profile-trace", metavar="DIR",
                   help=f"after training (and --profile), {TRACE_STEPS_TEXT}: "
                        "a Chrome trace per rank, DIR/rankR.json (chrome://tracing, ui.perfetto.dev)")
    r.add_argument("--metrics", metavar="FILE.jsonl",
                   help="write one JSON object per training step (loss, tokens/s, lr, grad norm, peak memory per rank, "
                        "MoE expert load) to FILE; an existing FILE is refused unless --resume is given (then appended to)")
    r.add_argument("--tensorboard", metavar="DIR",
                   help="also write loss, tokens/s, lr, grad norm and peak memory per step as TensorBoard scalars in DIR "
                        "(needs `pip install tensorboard`)")
    r.set_defaults(func=cmd_run)

    v = sub.add_parser("verify", help="tiny-twin equivalence: sharded vs unsharded outputs and gradients on CPU")
    v.add_argument("file", metavar="FILE")
    v.add_argument("--plan", help="which plan (default: the first by name)")
    v.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="how long the processes may take to start, and then to compare "
                        "(default: 120 s plus 10 s per process, at least 300 s)")
    v.add_argument("--microbatches", type=int, metavar="N",
                   help="compare with N microbatches a step instead of the plan's: fewer make a big pipelined twin "
                        "much faster to check, but do not exercise the plan's own count")
    v.set_defaults(func=cmd_verify)
