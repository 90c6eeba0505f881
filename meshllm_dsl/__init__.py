"""meshllm: describe how a large language model is split over devices, check it, compile it.

The pipeline, one module per stage: grammar/mesh.lark -> parser (text -> ast) -> load (includes)
-> resolve (names, dims, primitives) -> checker (placements, layouts, stages: ir.PlanIR) -> codegen
(templates) -> runtime (torch.distributed).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshllm_dsl.checker import CheckResult, check_file, check_text
    from meshllm_dsl.diagnostics import Diagnostic, SpecError
    from meshllm_dsl.front.ast import Module
    from meshllm_dsl.front.fmt import format_text
    from meshllm_dsl.front.parser import parse
    from meshllm_dsl.ir import PlanIR

# Names resolve on first use (PEP 562): every `meshllm_dsl.x` import runs this file first, so an eager
# import here made `meshc check` pay for the whole pipeline before parsing its arguments, and every
# rank of a job (on its way to meshllm_dsl.runtime) about 0.3 CPU-s for the front end (issue 12).
_WHERE = {
    "Module": "front.ast",
    **dict.fromkeys(("CheckResult", "check_file", "check_text"), "checker"),
    **dict.fromkeys(("Diagnostic", "SpecError"), "diagnostics"),
    "format_text": "front.fmt",
    "PlanIR": "ir",
    "parse": "front.parser",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

__all__ = [
    "CheckResult",
    "Diagnostic",
    "Module",
    "PlanIR",
    "SpecError",
    "check",
    "check_file",
    "compile",
    "check_text",
    "format_text",
    "parse",
]
__version__ = "0.1.0"


def check(path_or_text: str, *, text: bool = False) -> CheckResult:
    """Check a .mesh file (or, with text=True, .mesh source) and return diagnostics and plans."""
    from meshllm_dsl.checker import check_file, check_text

    return check_text(path_or_text) if text else check_file(path_or_text)


def compile(path: str, out_dir: str | None = None) -> dict[str, str]:  # noqa: A001 - mirrors `meshc compile`
    """Compile every plan of a .mesh file: file name -> generated source (written to out_dir if given).

    Raises SpecError with every diagnostic when the spec has errors, and meshllm_dsl.runtime.outputs.OutputError
    (writing nothing) when out_dir holds files that meshc did not write, as `meshc compile -o` does.
    """
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.codegen.emit import render_package
    from meshllm_dsl.diagnostics import SpecError
    from meshllm_dsl.runtime.outputs import write_generated

    result = check_file(path)
    if not result.ok:
        raise SpecError(result.errors)
    files = render_package(result, path)
    if out_dir is not None:
        write_generated(files, out_dir, protect=result.sources)
    return files
