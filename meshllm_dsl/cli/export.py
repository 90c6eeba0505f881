"""`meshc export FILE --plan P --to dtensor|hf-tp-plan|torchtitan|hf-ep-plan|megatron -o OUT`: a checked plan for other tools.

`--to dtensor` writes a Python module with `parallelize(model, mesh)` (torch's parallelize_module and
fully_shard over transformers' module names); `--to hf-tp-plan` writes transformers' `tp_plan` as
JSON; `--to hf-ep-plan` a mixture-of-experts plan as transformers' `DistributedConfig` arguments (its
`ep_plan` and the expert / FSDP sizes) as JSON; `--to megatron` Megatron-LM's pretrain_gpt.py flags. Exit 0 written (warnings included), 1 errors in the spec or a plan the target cannot express,
2 usage. Torch is not imported here; runtime/hf/weights.py (the module names) imports it when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from meshllm_dsl.diagnostics import SpecError, render_all

TARGETS = ("dtensor", "hf-tp-plan", "torchtitan", "hf-ep-plan", "megatron")


def cmd_export(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli.main import UsageError, existing
    from meshllm_dsl.runtime.outputs import check_new_file, write_output

    path = existing(args.file)[0]
    out = Path(args.output)
    if args.to in ("torchtitan", "megatron"):
        return _engine(args, path, out)
    check_new_file(out, {"dtensor": "exported plan", "hf-ep-plan": "DistributedConfig"}.get(args.to, "tp_plan"),
                   args.force)
    if args.to == "hf-ep-plan" and args.weights:
        raise UsageError("--weights is for --to dtensor / hf-tp-plan; the model's own class names the experts")
    checked = _checked_plan(args, path)
    if isinstance(checked, int):
        return checked
    plan, decls, text = checked
    from meshllm_dsl.interop.export import export_plan
    from meshllm_dsl.interop.hf_ep import export_ep_plan

    try:
        written, warnings = (export_ep_plan(plan, decls) if args.to == "hf-ep-plan"
                             else export_plan(plan, decls, args.to, path, text, args.weights))
    except SpecError as err:
        print(render_all(err.diagnostics), end="", file=sys.stderr)
        return 1
    if warnings:
        print(render_all(warnings), end="", file=sys.stderr)
    write_output(out, written.encode())
    print(f"wrote {out}")
    return 0


def _checked_plan(args: argparse.Namespace, path: str) -> tuple[Any, Any, str] | int:
    """The plan to export (`--plan`, or the file's only one), its declarations and the spec's text;
    1 after printing the spec's errors. Warnings are printed either way."""
    from meshllm_dsl.checker import check_declarations
    from meshllm_dsl.cli.main import UsageError, select_plans
    from meshllm_dsl.front.load import load

    decls = load(path)
    result = check_declarations(decls)
    if result.diagnostics:
        print(render_all(result.diagnostics), end="", file=sys.stderr)
    if not result.ok:
        return 1
    name = select_plans(result.plans, path, args.plan)
    if len(name) > 1:
        raise UsageError(f"{path} has plans {', '.join(name)}; name one with --plan")
    return result.plans[name[0]], decls, result.text


def _engine(args: argparse.Namespace, path: str, out: Path) -> int:
    """`--to torchtitan`: OUT (the torchrun line) and OUT's stem + `_config.py` (its config_registry);
    `--to megatron`: OUT (the torchrun pretrain_gpt.py line)."""
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.interop.megatron import export_megatron
    from meshllm_dsl.interop.torchtitan import export_torchtitan
    from meshllm_dsl.runtime.outputs import check_new_file, write_output

    if args.weights:
        raise UsageError(f"--weights is for --to dtensor / hf-tp-plan; {args.to} builds its own model")
    checked = _checked_plan(args, path)
    if isinstance(checked, int):
        return checked
    plan, decls, text = checked
    export = export_torchtitan if args.to == "torchtitan" else export_megatron
    try:
        files, warnings = export(plan, decls, str(path), text, out)
    except SpecError as err:
        print(render_all(err.diagnostics), end="", file=sys.stderr)
        return 1
    if warnings:
        print(render_all(warnings), end="", file=sys.stderr)
    for f in files:
        check_new_file(f, f"{args.to} launch" if f == out else "torchtitan config_registry", args.force)
    for f, content in files.items():
        write_output(f, content.encode())
        print(f"wrote {f}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    e = sub.add_parser("export", help="write a checked plan as torch DTensor code, a transformers tp_plan / ep_plan or torchtitan's line")
    e.add_argument("file", metavar="FILE")
    e.add_argument("--plan", metavar="P", help="the plan to export (needed when the spec has several)")
    e.add_argument("--to", required=True, choices=TARGETS,  # export.TARGETS, not imported: registering must stay light
                   help="dtensor: a module with parallelize(model, mesh); hf-tp-plan: transformers' tp_plan JSON; "
                        "torchtitan: torchtitan 0.3's torchrun line (OUT) and its config_registry (OUT_config.py); "
                        "hf-ep-plan: transformers' DistributedConfig arguments (ep_plan, ep / fsdp sizes) as JSON; "
                        "megatron: Megatron-LM's torchrun pretrain_gpt.py line (OUT)")
    e.add_argument("--weights", metavar="DIR",
                   help="the checkpoint the model is of: its config.json's class names the modules (Phi-3's fused "
                        "qkv_proj, which a llama-family model alone does not say)")
    e.add_argument("-o", "--output", required=True, metavar="OUT", help="the file to write")
    e.add_argument("--force", action="store_true", help="replace OUT if it exists")
    e.set_defaults(func=cmd_export)
