"""`meshc export FILE --plan P --to dtensor|hf-tp-plan|torchtitan -o OUT`: a checked plan for other tools.

`--to dtensor` writes a Python module with `parallelize(model, mesh)` (torch's parallelize_module and
fully_shard over transformers' module names); `--to hf-tp-plan` writes transformers' `tp_plan` as
JSON. Exit 0 written (warnings included), 1 errors in the spec or a plan the target cannot express,
2 usage. Torch is not imported here; runtime/hf/weights.py (the module names) imports it when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshllm_dsl.diagnostics import SpecError, render_all

TARGETS = ("dtensor", "hf-tp-plan", "torchtitan")


def cmd_export(args: argparse.Namespace) -> int:
    from meshllm_dsl.checker import check_declarations
    from meshllm_dsl.cli.main import existing, select_plans
    from meshllm_dsl.front.load import load
    from meshllm_dsl.interop.export import export_plan
    from meshllm_dsl.runtime.outputs import check_new_file, write_output

    path = existing(args.file)[0]
    out = Path(args.output)
    if args.to == "torchtitan":
        return _torchtitan(args, path, out)
    check_new_file(out, "exported plan" if args.to == "dtensor" else "tp_plan", args.force)
    decls = load(path)
    result = check_declarations(decls)
    if result.diagnostics:
        print(render_all(result.diagnostics), end="", file=sys.stderr)
    if not result.ok:
        return 1
    name = select_plans(result.plans, path, args.plan)
    if len(name) > 1:
        from meshllm_dsl.cli.main import UsageError

        raise UsageError(f"{path} has plans {', '.join(name)}; name one with --plan")
    try:
        text, warnings = export_plan(result.plans[name[0]], decls, args.to, path, result.text, args.weights)
    except SpecError as err:
        print(render_all(err.diagnostics), end="", file=sys.stderr)
        return 1
    if warnings:
        print(render_all(warnings), end="", file=sys.stderr)
    write_output(out, text.encode())
    print(f"wrote {out}")
    return 0


def _torchtitan(args: argparse.Namespace, path: str, out: Path) -> int:
    """`--to torchtitan`: OUT (the torchrun line) and OUT's stem + `_config.py` (its config_registry)."""
    from meshllm_dsl.checker import check_declarations
    from meshllm_dsl.cli.main import UsageError, select_plans
    from meshllm_dsl.front.load import load
    from meshllm_dsl.interop.torchtitan import export_torchtitan
    from meshllm_dsl.runtime.outputs import check_new_file, write_output

    if args.weights:
        raise UsageError("--weights is for --to dtensor / hf-tp-plan; torchtitan builds its own llama3")
    decls = load(path)
    result = check_declarations(decls)
    if result.diagnostics:
        print(render_all(result.diagnostics), end="", file=sys.stderr)
    if not result.ok:
        return 1
    name = select_plans(result.plans, path, args.plan)
    if len(name) > 1:
        raise UsageError(f"{path} has plans {', '.join(name)}; name one with --plan")
    try:
        files, _ = export_torchtitan(result.plans[name[0]], decls, str(path), result.text, out)
    except SpecError as err:
        print(render_all(err.diagnostics), end="", file=sys.stderr)
        return 1
    for f in files:
        check_new_file(f, "torchtitan launch" if f == out else "torchtitan config_registry", args.force)
    for f, text in files.items():
        write_output(f, text.encode())
        print(f"wrote {f}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    e = sub.add_parser("export", help="write a checked plan as torch DTensor code or a transformers tp_plan")
    e.add_argument("file", metavar="FILE")
    e.add_argument("--plan", metavar="P", help="the plan to export (needed when the spec has several)")
    e.add_argument("--to", required=True, choices=TARGETS,  # export.TARGETS, not imported: registering must stay light
                   help="dtensor: a module with parallelize(model, mesh); hf-tp-plan: transformers' tp_plan JSON; "
                        "torchtitan: torchtitan 0.3's torchrun line (OUT) and its config_registry (OUT_config.py)")
    e.add_argument("--weights", metavar="DIR",
                   help="the checkpoint the model is of: its config.json's class names the modules (Phi-3's fused "
                        "qkv_proj, which a llama-family model alone does not say)")
    e.add_argument("-o", "--output", required=True, metavar="OUT", help="the file to write")
    e.add_argument("--force", action="store_true", help="replace OUT if it exists")
    e.set_defaults(func=cmd_export)
