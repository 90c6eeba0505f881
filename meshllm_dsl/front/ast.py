"""The typed syntax tree of a .mesh file.

Nodes are frozen records. Spans do not take part in equality, so `parse(fmt(x)) == parse(x)`
compares structure only.

They are made by `_node` rather than attrs: attrs builds each class at import (1-2 ms apiece, 32
classes, paid by every `meshc` start: issue 12), while `_node` compiles the constructors, `==` and
`hash` of all of them in one go at the end of this module. Type checkers see attrs classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from attrs.exceptions import FrozenInstanceError

from meshllm_dsl.front.source import Span

if TYPE_CHECKING:
    import attrs

    node = attrs.frozen
    _span = attrs.field(eq=False, repr=False, default=None)
else:
    _span = None


class _Node:
    """A frozen record: positional or keyword fields, `span` left out of `==`, `hash` and `repr`."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError()

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError()

    def __repr__(self) -> str:
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields if f != "span")
        return f"{type(self).__name__}({shown})"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), tuple(getattr(self, f) for f in self._fields)


_PENDING: list[tuple[type, tuple[str, ...], dict[str, Any]]] = []


def _node(cls: type) -> type:
    fields = tuple(cls.__annotations__)
    defaults = {f: cls.__dict__[f] for f in fields if f in cls.__dict__}
    namespace = {k: v for k, v in cls.__dict__.items() if k not in fields and k not in ("__dict__", "__weakref__")}
    namespace.update(__slots__=fields, _fields=fields, __match_args__=fields)
    made = type(cls.__name__, (_Node,), namespace)
    _PENDING.append((made, fields, defaults))
    return made


def _define_methods() -> None:
    """`__init__`, `__eq__` and `__hash__` of every node class, compiled as one module."""
    lines: list[str] = []
    values: dict[str, Any] = {"_set": object.__setattr__}
    for i, (_cls, fields, defaults) in enumerate(_PENDING):
        params = []
        for f in fields:
            if f in defaults:
                values[f"_d{i}_{f}"] = defaults[f]
                params.append(f"{f}=_d{i}_{f}")
            else:
                params.append(f)
        compared = [f for f in fields if f != "span"]
        mine = "".join(f"self.{f}, " for f in compared)
        theirs = "".join(f"other.{f}, " for f in compared)
        lines += [
            f"def _init{i}(self, {', '.join(params)}):",
            *(f"    _set(self, {f!r}, {f})" for f in fields),
            f"def _eq{i}(self, other):",
            "    if other.__class__ is not self.__class__:",
            "        return NotImplemented",
            f"    return ({mine}) == ({theirs})",
            f"def _hash{i}(self):",
            f"    return hash(({i}, {mine}))",
        ]
    exec(compile("\n".join(lines), "<meshllm_dsl.front.ast nodes>", "exec"), values)  # noqa: S102 - our own text
    for i, (cls, _fields, _defaults) in enumerate(_PENDING):
        type.__setattr__(cls, "__init__", values[f"_init{i}"])
        type.__setattr__(cls, "__eq__", values[f"_eq{i}"])
        type.__setattr__(cls, "__hash__", values[f"_hash{i}"])
    _PENDING.clear()


if not TYPE_CHECKING:
    node = _node


# ---------------------------------------------------------------- expressions


@node
class Name:
    value: str
    span: Span | None = _span


@node
class IntLit:
    value: int
    span: Span | None = _span


@node
class FloatLit:
    text: str  # kept as written so formatting round-trips exactly
    span: Span | None = _span

    @property
    def value(self) -> float:
        return float(self.text)


@node
class StrLit:
    value: str
    span: Span | None = _span


@node
class BinOp:
    op: str  # one of + - * /
    left: Expr
    right: Expr
    span: Span | None = _span


@node
class Neg:
    operand: Expr
    span: Span | None = _span


Expr = Name | IntLit | FloatLit | StrLit | BinOp | Neg


@node
class ListLit:
    """`[1.0, 1.5, 2.0]`: a list of expressions, the value of a model setting, family parameter or
    layer argument (never an operand: lists take no arithmetic)."""

    items: tuple[Expr, ...]
    span: Span | None = _span


Value = Expr | ListLit


def names_in(value: Value | None) -> Iterator[Name]:
    """Every name an expression or list reads, in source order (None: none)."""
    if isinstance(value, Name):
        yield value
    elif isinstance(value, ListLit):
        for item in value.items:
            yield from names_in(item)
    elif isinstance(value, BinOp):
        yield from names_in(value.left)
        yield from names_in(value.right)
    elif isinstance(value, Neg):
        yield from names_in(value.operand)


@node
class Setting:
    name: Name
    value: Value
    span: Span | None = _span
    every: Expr | None = None  # `recompute = blocks every N` (plans only)


# ---------------------------------------------------------------- devices and meshes


@node
class DeviceDecl:
    name: Name
    settings: tuple[Setting, ...]
    span: Span | None = _span


@node
class AxisDecl:
    name: Name
    size: Expr
    span: Span | None = _span


@node
class MeshDecl:
    name: Name
    axes: tuple[AxisDecl, ...]
    settings: tuple[Setting, ...]
    span: Span | None = _span


# ---------------------------------------------------------------- models


@node
class Call:
    func: Name
    args: tuple[Value, ...]
    kwargs: tuple[Setting, ...]
    span: Span | None = _span


@node
class LayerDecl:
    name: Name
    call: Call
    span: Span | None = _span


@node
class RepeatDecl:
    name: Name
    count: Expr
    body: tuple[LayerStmt, ...]
    span: Span | None = _span


LayerStmt = LayerDecl | RepeatDecl


@node
class Param:
    name: Name
    default: Value | None
    span: Span | None = _span


@node
class FamilyDecl:
    name: Name
    params: tuple[Param, ...]
    body: tuple[LayerStmt, ...]
    span: Span | None = _span


@node
class ModelDecl:
    """`model NAME = FAMILY { args }` (family set) or `model NAME { dims and layers }`."""

    name: Name
    family: Name | None
    settings: tuple[Setting, ...]
    body: tuple[LayerStmt, ...]
    span: Span | None = _span


# ---------------------------------------------------------------- plans


@node
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


@node
class Path:
    segments: tuple[PathSegment, ...]
    span: Span | None = _span

    def __str__(self) -> str:
        return ".".join(str(s) for s in self.segments)


@node
class Rule:
    """`column(tensor)`, `row(tensor)`, `vocab_parallel(tensor)`, `replicate`."""

    name: Name
    axes: tuple[Name, ...]
    span: Span | None = _span


@node
class ShardStmt:
    path: Path
    rule: Rule
    span: Span | None = _span


@node
class LossStmt:
    rule: Rule
    span: Span | None = _span


@node
class LayoutEntry:
    dim: Name
    axes: tuple[Name, ...]
    span: Span | None = _span


@node
class LayoutStmt:
    entries: tuple[LayoutEntry, ...]
    span: Span | None = _span


@node
class StageItem:
    name: Name
    start: int | None
    stop: int | None
    span: Span | None = _span


@node
class StageEntry:
    index: IntLit
    items: tuple[StageItem, ...]
    span: Span | None = _span


@node
class StagesStmt:
    axis: Name
    virtual: Expr | None
    balanced: bool
    entries: tuple[StageEntry, ...]
    span: Span | None = _span
    placement: Name | None = None  # `placement v` / `placement loop`; None: the schedule's


@node
class ScheduleStmt:
    name: Name
    span: Span | None = _span


@node
class ZeroStmt:
    stage: IntLit
    axes: tuple[Name, ...]
    span: Span | None = _span


@node
class OptimizerStmt:
    name: Name
    zero: ZeroStmt | None
    settings: tuple[Setting, ...]
    span: Span | None = _span


@node
class PrecisionStmt:
    settings: tuple[Setting, ...]
    span: Span | None = _span


@node
class PrecisionRule:
    """`precision PATH matmul = RECIPE`: the matmul recipe of every linear layer under PATH."""

    path: Path
    setting: Setting
    span: Span | None = _span


PlanStmt = (Setting | ShardStmt | LossStmt | LayoutStmt | StagesStmt | ScheduleStmt | OptimizerStmt | PrecisionStmt
            | PrecisionRule)


@node
class PlanDecl:
    name: Name
    mesh: Name
    model: Name
    body: tuple[PlanStmt, ...]
    span: Span | None = _span


@node
class Include:
    path: StrLit
    span: Span | None = _span


Item = Include | DeviceDecl | MeshDecl | FamilyDecl | ModelDecl | PlanDecl


@node
class Module:
    items: tuple[Item, ...]
    span: Span | None = _span


_define_methods()
