"""The typed syntax tree of a .mesh file.

Nodes are frozen attrs classes. Spans do not take part in equality, so `parse(fmt(x)) == parse(x)`
compares structure only.
"""

from __future__ import annotations

import attrs

from meshllm_dsl.source import Span

_span = attrs.field(eq=False, repr=False, default=None)


# ---------------------------------------------------------------- expressions


@attrs.frozen
class Name:
    value: str
    span: Span | None = _span


@attrs.frozen
class IntLit:
    value: int
    span: Span | None = _span


@attrs.frozen
class FloatLit:
    text: str  # kept as written so formatting round-trips exactly
    span: Span | None = _span

    @property
    def value(self) -> float:
        return float(self.text)


@attrs.frozen
class StrLit:
    value: str
    span: Span | None = _span


@attrs.frozen
class BinOp:
    op: str  # one of + - * /
    left: Expr
    right: Expr
    span: Span | None = _span


@attrs.frozen
class Neg:
    operand: Expr
    span: Span | None = _span


Expr = Name | IntLit | FloatLit | StrLit | BinOp | Neg


@attrs.frozen
class Setting:
    name: Name
    value: Expr
    span: Span | None = _span


# ---------------------------------------------------------------- devices and meshes


@attrs.frozen
class DeviceDecl:
    name: Name
    settings: tuple[Setting, ...]
    span: Span | None = _span


@attrs.frozen
class AxisDecl:
    name: Name
    size: Expr
    span: Span | None = _span


@attrs.frozen
class MeshDecl:
    name: Name
    axes: tuple[AxisDecl, ...]
    settings: tuple[Setting, ...]
    span: Span | None = _span


# ---------------------------------------------------------------- models


@attrs.frozen
class Call:
    func: Name
    args: tuple[Expr, ...]
    kwargs: tuple[Setting, ...]
    span: Span | None = _span


@attrs.frozen
class LayerDecl:
    name: Name
    call: Call
    span: Span | None = _span


@attrs.frozen
class RepeatDecl:
    name: Name
    count: Expr
    body: tuple[LayerStmt, ...]
    span: Span | None = _span


LayerStmt = LayerDecl | RepeatDecl


@attrs.frozen
class Param:
    name: Name
    default: Expr | None
    span: Span | None = _span


@attrs.frozen
class FamilyDecl:
    name: Name
    params: tuple[Param, ...]
    body: tuple[LayerStmt, ...]
    span: Span | None = _span


@attrs.frozen
class ModelDecl:
    """`model NAME = FAMILY { args }` (family set) or `model NAME { dims and layers }`."""

    name: Name
    family: Name | None
    settings: tuple[Setting, ...]
    body: tuple[LayerStmt, ...]
    span: Span | None = _span


# ---------------------------------------------------------------- plans


@attrs.frozen
class PathSegment:
    """One segment of a layer path pattern: a name, `*`, an index or `{a,b}`."""

    kind: str  # "name" | "star" | "index" | "alt"
    names: tuple[str, ...] = ()
    index: int = 0
    span: Span | None = _span

    def __str__(self) -> str:
        if self.kind == "star":
            return "*"
        if self.kind == "index":
            return str(self.index)
        if self.kind == "alt":
            return "{" + ",".join(self.names) + "}"
        return self.names[0]


@attrs.frozen
class Path:
    segments: tuple[PathSegment, ...]
    span: Span | None = _span

    def __str__(self) -> str:
        return ".".join(str(s) for s in self.segments)


@attrs.frozen
class Rule:
    """`column(tensor)`, `row(tensor)`, `vocab_parallel(tensor)`, `replicate`."""

    name: Name
    axes: tuple[Name, ...]
    span: Span | None = _span


@attrs.frozen
class ShardStmt:
    path: Path
    rule: Rule
    span: Span | None = _span


@attrs.frozen
class LossStmt:
    rule: Rule
    span: Span | None = _span


@attrs.frozen
class LayoutEntry:
    dim: Name
    axes: tuple[Name, ...]
    span: Span | None = _span


@attrs.frozen
class LayoutStmt:
    entries: tuple[LayoutEntry, ...]
    span: Span | None = _span


@attrs.frozen
class StageItem:
    name: Name
    start: int | None
    stop: int | None
    span: Span | None = _span


@attrs.frozen
class StageEntry:
    index: IntLit
    items: tuple[StageItem, ...]
    span: Span | None = _span


@attrs.frozen
class StagesStmt:
    axis: Name
    virtual: Expr | None
    balanced: bool
    entries: tuple[StageEntry, ...]
    span: Span | None = _span


@attrs.frozen
class ScheduleStmt:
    name: Name
    span: Span | None = _span


@attrs.frozen
class ZeroStmt:
    stage: IntLit
    axes: tuple[Name, ...]
    span: Span | None = _span


@attrs.frozen
class OptimizerStmt:
    name: Name
    zero: ZeroStmt | None
    settings: tuple[Setting, ...]
    span: Span | None = _span


@attrs.frozen
class PrecisionStmt:
    settings: tuple[Setting, ...]
    span: Span | None = _span


PlanStmt = Setting | ShardStmt | LossStmt | LayoutStmt | StagesStmt | ScheduleStmt | OptimizerStmt | PrecisionStmt


@attrs.frozen
class PlanDecl:
    name: Name
    mesh: Name
    model: Name
    body: tuple[PlanStmt, ...]
    span: Span | None = _span


@attrs.frozen
class Include:
    path: StrLit
    span: Span | None = _span


Item = Include | DeviceDecl | MeshDecl | FamilyDecl | ModelDecl | PlanDecl


@attrs.frozen
class Module:
    items: tuple[Item, ...]
    span: Span | None = _span
