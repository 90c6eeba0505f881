"""`meshc plan`, `meshc explain` and `meshc suggest`: look at a plan before spending GPU hours.

None of these import torch (`plan --data` does, to pack the data's rows). `plan` and `explain` exit 0 for a spec without errors (warnings included)
and 1 when the spec has errors; `suggest` exits 1 when no candidate passes the checker and fits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import attrs

from meshllm_dsl.checker import CheckResult, check_declarations
from meshllm_dsl.codes import W0702, W0804
from meshllm_dsl.diagnostics import Diagnostic, render_all
from meshllm_dsl.front import ast
from meshllm_dsl.front.load import load
from meshllm_dsl.ir import PlanIR
from meshllm_dsl.parallel.devices import PROFILES, DeviceProfile, declared_profiles

EXIT_OK, EXIT_SPEC = 0, 1


@attrs.frozen
class Loaded:
    result: CheckResult
    devices: dict[str, DeviceProfile]
    diagnostics: tuple[Diagnostic, ...]  # the checker's plus the device declarations'

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


def load_checked(path: str) -> Loaded:
    """Check a file and read its `device` declarations (the checker reports what is wrong with them)."""
    decls = load(path)
    result = check_declarations(decls)
    devices, _diags = declared_profiles(decls.user(ast.DeviceDecl))
    return Loaded(result, devices, result.diagnostics)


def _existing(path: str) -> str:
    from meshllm_dsl.cli.main import existing

    return existing(path)[0]


def _select(loaded: Loaded, name: str | None) -> list[PlanIR]:
    from meshllm_dsl.cli.main import select_plans

    plans = loaded.result.plans
    return [plans[n] for n in select_plans(plans, loaded.result.sources[0] if loaded.result.sources else "spec", name)]


def _print_diags(diags: list[Diagnostic]) -> None:
    text = render_all(diags)
    if text:
        print(text, end="", file=sys.stderr if any(d.is_error for d in diags) else sys.stdout)


# ---------------------------------------------------------------- meshc plan


def cmd_plan(args: argparse.Namespace) -> int:
    from meshllm_dsl.planner.analyze import analyze, resolve_device
    from meshllm_dsl.planner.report import report_json, report_text
    from meshllm_dsl.planner.warnings import plan_warnings

    loaded = load_checked(_existing(args.file))
    if not loaded.ok:
        _print_diags(list(loaded.diagnostics))
        return EXIT_SPEC
    plans = _select(loaded, args.plan)
    corpora = _plan_data(args)
    reports, warns, datas = [], list(loaded.diagnostics), []
    for plan in plans:
        device, assumed = resolve_device(plan, loaded.devices, args.device)
        rep = analyze(plan, device, device_assumed=assumed)
        reports.append(rep)
        mine = plan_warnings(rep)
        if corpora is not None:
            da = _data_attention(rep, corpora, args)
            datas.append(da)
            mine.extend(_data_warnings(rep, da))
        # W0804 states what the checker's W0702 does, with the seconds it costs: keep the richer one.
        covered = {d.span.start for d in mine if d.code == W0804 and d.span is not None}
        warns = [d for d in warns if not (d.code == W0702 and any(
            lab.span.start in covered for lab in d.secondary))]
        warns.extend(mine)
    if args.format == "json":
        jsons = [report_json(r) for r in reports]
        for js, da in zip(jsons, datas):
            js["data"] = _data_json(da, args.data)
        print(json.dumps({"plans": jsons, "diagnostics": [d.to_json() for d in warns]}, indent=2))
        _write_svgs(args, plans, reports)
        return EXIT_OK
    for i, rep in enumerate(reports):
        if i:
            print()
        print(report_text(rep), end="")
        if datas:
            print("\n".join(_data_lines(datas[i], args.data)))
    if warns:
        print()
        _print_diags(warns)
    _write_svgs(args, plans, reports)
    return EXIT_OK


# ---------------------------------------------------------------- the data's attention (plan --data, data-stats --plan)
#
# Only on these paths: tokenizing and packing (numpy, and torch through runtime/data/packing.py)
# stay out of a plain `meshc plan`, which imports neither.


def _plan_data(args: argparse.Namespace) -> list[Any] | None:
    """`plan --data SPEC`: its corpora, tokenized into --data-cache as `meshc run` does; None without --data."""
    if args.data is None:
        return None
    from meshllm_dsl.cli.data import data_corpora

    return data_corpora(args.data, args.tokenizer, args)


def _data_attention(rep: Any, corpora: list[Any], args: argparse.Namespace) -> Any:
    from meshllm_dsl.cli.data import measure_data
    from meshllm_dsl.planner.data import data_attention

    return data_attention(rep, measure_data(corpora, rep.plan, seed=args.seed, steps=args.steps, balance=args.balance))


def _data_warnings(rep: Any, da: Any) -> list[Diagnostic]:
    from meshllm_dsl.planner.data import data_warnings

    return data_warnings(rep, da)


def _data_lines(da: Any, source: str) -> list[str]:
    from meshllm_dsl.planner.data import data_lines

    return data_lines(da, source)


def _data_json(da: Any, source: str) -> dict[str, Any]:
    from meshllm_dsl.planner.data import data_json

    return data_json(da, source)


def data_report(path: str, plan_name: str | None, corpora: list[Any], source: str, args: argparse.Namespace) -> int:
    """`meshc data-stats --plan FILE`: each selected plan's data ranks on these corpora, and W0808."""
    from meshllm_dsl.planner.analyze import analyze, resolve_device

    loaded = load_checked(_existing(path))
    if not loaded.ok:
        _print_diags(list(loaded.diagnostics))
        return EXIT_SPEC
    warns: list[Diagnostic] = []
    for plan in _select(loaded, plan_name):
        device, assumed = resolve_device(plan, loaded.devices, None)
        rep = analyze(plan, device, device_assumed=assumed)
        da = _data_attention(rep, corpora, args)
        print()
        contexts = f" x {plan.context_size} context ranks" if plan.context_size > 1 else ""
        print(f"plan `{plan.name}`: batch {plan.batch} x seq {plan.seq:,} over {plan.data_size} data ranks{contexts} "
              f"on {device.name}")
        print("\n".join(_data_lines(da, source)))
        warns.extend(_data_warnings(rep, da))
    if warns:
        print()
        _print_diags(warns)
    return EXIT_OK


# ---------------------------------------------------------------- meshc explain


def cmd_explain(args: argparse.Namespace) -> int:
    from meshllm_dsl.views.explain import explain_json, explain_text

    loaded = load_checked(_existing(args.file))
    if not loaded.ok:
        _print_diags(list(loaded.diagnostics))
        return EXIT_SPEC
    plans = _select(loaded, args.plan)
    if args.format == "json":
        print(json.dumps({"plans": [explain_json(p) for p in plans]}, indent=2))
    else:
        for i, plan in enumerate(plans):
            if i:
                print()
            print(explain_text(plan), end="")
    _write_svgs(args, plans)
    return EXIT_OK


def _write_svgs(args: argparse.Namespace, plans: list[Any], reports: list[Any] | None = None) -> None:
    """`--svg DIR`: each plan's mesh and its pipeline schedule (every rank's actions over time), and
    with `meshc plan` its memory per rank against the device's."""
    if not args.svg:
        return
    from meshllm_dsl.views.charts import memory_svg
    from meshllm_dsl.views.svg import mesh_svg, schedule_svg

    out = Path(args.svg)
    out.mkdir(parents=True, exist_ok=True)
    for k, plan in enumerate(plans):
        pictures = [("mesh", mesh_svg(plan)), ("schedule", schedule_svg(plan))]
        if reports is not None:
            pictures.append(("memory", memory_svg(reports[k])))
        for kind, text in pictures:
            target = out / f"{plan.name}_{kind}.svg"
            target.write_text(text)
            print(f"wrote {target}", file=sys.stderr if args.format == "json" else sys.stdout)


# ---------------------------------------------------------------- meshc suggest


def cmd_suggest(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.planner.suggest import suggest, suggestion_json, suggestion_text

    path = _existing(args.file)
    loaded = load_checked(path)
    if not loaded.ok:
        _print_diags(list(loaded.diagnostics))
        return EXIT_SPEC
    profiles = {**PROFILES, **loaded.devices}
    if args.device not in profiles:
        raise UsageError(f"unknown device `{args.device}` (known: {', '.join(sorted(profiles))})")
    models = loaded.result.models
    if args.model is not None and args.model not in models:
        raise UsageError(f"no model `{args.model}` (models: {', '.join(models)})")
    if not models:
        raise UsageError(f"{path} declares no model")
    model = models[args.model] if args.model else next(iter(models.values()))
    first_plan = next((p for p in loaded.result.plans.values() if p.model.name == model.name), None)
    batch = args.batch or (first_plan.batch if first_plan else max(8, args.devices))
    seq = args.seq or (first_plan.seq if first_plan else 2048)
    if args.devices < 1 or batch < 1 or seq < 1:
        raise UsageError("--devices, --batch and --seq must be positive")
    device = profiles[args.device]
    headroom = headroom_bytes(args.headroom, device)
    result = suggest(path, model.name, devices=args.devices, device=device, batch=batch, seq=seq,
                     per_host=args.per_host, top=args.top, headroom_bytes=headroom)
    if args.format == "json":
        print(json.dumps(suggestion_json(result), indent=2))
    else:
        print(suggestion_text(result), end="")
    if args.svg:
        from meshllm_dsl.views.charts import suggest_svg

        target = Path(args.svg)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(suggest_svg(list(result.points), [r.candidate.key() for r in result.ranked],
                                      result.device.memory_bytes - result.headroom_bytes,
                                      f"meshc suggest: {result.model} on {result.devices} x {result.device.name}, "
                                      f"batch {result.batch} x seq {result.seq}"))
        print(f"wrote {target}", file=sys.stderr if args.format == "json" else sys.stdout)
    return EXIT_OK if result.best else EXIT_SPEC


def headroom_bytes(gib: float | None, device: DeviceProfile) -> int | None:
    """--headroom in GiB as bytes (None: planner_suggest's default share of the device)."""
    from meshllm_dsl.cli.main import UsageError

    if gib is None:
        return None
    total = device.memory_bytes / 2**30
    if not math.isfinite(gib) or not 0 <= gib < total:
        raise UsageError(f"--headroom: expected GiB from 0 to less than {device.name}'s {total:g} GiB, got {gib:g}")
    return int(gib * 2**30)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="memory per device, communication, bubble, step time and warnings")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--plan", help="only this plan (default: every plan in the file)")
    p.add_argument("--device", help="device profile to assume instead of the mesh's")
    p.add_argument("--svg", metavar="DIR", help="also write PLAN_mesh.svg, PLAN_schedule.svg and PLAN_memory.svg to DIR")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--data", metavar="SPEC",
                   help="price attention by this data's documents (as `meshc run --data` takes it): each data rank's "
                        "share of tokens and attention work over the first steps, and W0808 when they are uneven")
    p.add_argument("--tokenizer", metavar="DIR", help="with --data: the tokenizer of sources that are not token files")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="with --data: the JSONL / Parquet / dataset field of each document (default: text)")
    p.add_argument("--skip-bad", action="store_true", help="with --data: skip and count unusable records")
    from meshllm_dsl.cli.data import add_data_plan_flags

    add_data_plan_flags(p)
    p.set_defaults(func=cmd_plan)

    e = sub.add_parser("explain", help="rank -> mesh coordinates, process groups, per-layer placement")
    e.add_argument("file", metavar="FILE")
    e.add_argument("--plan", help="only this plan (default: every plan in the file)")
    e.add_argument("--svg", metavar="DIR", help="also write PLAN_mesh.svg and PLAN_schedule.svg to DIR")
    e.add_argument("--format", choices=("text", "json"), default="text")
    e.set_defaults(func=cmd_explain)

    s = sub.add_parser("suggest", help="search data x pipeline x tensor plans that check clean and fit")
    s.add_argument("file", metavar="MODEL.mesh")
    s.add_argument("--devices", type=int, required=True, help="number of devices")
    s.add_argument("--device", default="h100", help="device profile (default h100)")
    s.add_argument("--model", help="model to plan (default: the file's first)")
    s.add_argument("--batch", type=int, help="global batch in sequences (default: the file's plan, else max(8, devices))")
    s.add_argument("--seq", type=int, help="sequence length (default: the file's plan, else 2048)")
    s.add_argument("--per-host", type=int, help="devices per host (default: the profile's)")
    s.add_argument("--top", type=int, default=3, help="how many plans to print (default 3)")
    s.add_argument("--headroom", type=float, metavar="GiB",
                   # planner_suggest.DEFAULT_HEADROOM (not imported here: every command would load the planner)
                   help="memory every suggested plan leaves free on a device (default 5 %% of the device's: the CUDA "
                   "context, NCCL's buffers and the allocator's fragmentation, which the planner does not count)")
    s.add_argument("--svg", metavar="FILE", help="also draw every analysed plan's step time against its peak memory")
    s.add_argument("--format", choices=("text", "json"), default="text")
    s.set_defaults(func=cmd_suggest)
