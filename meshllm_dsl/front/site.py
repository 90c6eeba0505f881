"""A layer declaration on its way to its ir.Unit: what resolve hands a layer kind's record
(meshllm_dsl/primitives `build`) once the call's arguments are bound.

It lives below both: resolve builds it, the records read it, and neither needs the other's module.
"""

from __future__ import annotations

from typing import Any

from meshllm_dsl.diagnostics import Reporter
from meshllm_dsl.front import ast
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import Tensor


class UnitSite:
    """A layer declaration being built into its ir.Unit by its kind's record: the bound arguments
    `b`, the logical dim each names (`lg`, for shard units) and where errors go."""

    def __init__(self, decl: ast.LayerDecl, b: dict[str, Any], lg: dict[str, str], r: Reporter,
                 spans: dict[str, Span | None] | None = None) -> None:
        self.decl, self.b, self.lg, self.r = decl, b, lg, r
        self.name, self.span = decl.name.value, decl.span
        self.spans = spans or {}  # argument -> where its value was written (a model's setting, through a family)

    def arg_span(self, arg: str) -> Span | None:
        """Where argument `arg`'s value was written, else the call."""
        return self.spans.get(arg) or self.decl.call.span

    def unit(self, dim: str) -> tuple[str, int]:
        """The shard unit of argument `dim`: its logical dim and size."""
        return (self.lg.get(dim, dim), self.b[dim])

    def vec(self, n: str, size_arg: str) -> Tensor:
        return Tensor(n, (self.b[size_arg],), ((self.unit(size_arg),),))
