"""meshllm: describe how a large language model is split over devices, check it, compile it.

The pipeline, one module per stage: grammar/mesh.lark -> parser (text -> ast) -> load (includes)
-> resolve (names, dims, primitives) -> check (placements, layouts, stages: ir.PlanIR) -> codegen
(templates) -> runtime (torch.distributed).
"""

from __future__ import annotations

from meshllm_dsl.ast import Module
from meshllm_dsl.check import CheckResult, check_file, check_text
from meshllm_dsl.diagnostics import Diagnostic, SpecError
from meshllm_dsl.fmt import format_text
from meshllm_dsl.ir import PlanIR
from meshllm_dsl.parser import parse

__all__ = [
    "CheckResult",
    "Diagnostic",
    "Module",
    "PlanIR",
    "SpecError",
    "check",
    "check_file",
    "check_text",
    "format_text",
    "parse",
]
__version__ = "0.1.0"


def check(path_or_text: str, *, text: bool = False) -> CheckResult:
    """Check a .mesh file (or, with text=True, .mesh source) and return diagnostics and plans."""
    return check_text(path_or_text) if text else check_file(path_or_text)
