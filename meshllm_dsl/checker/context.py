"""What every plan pass shares: the plan being checked, its mesh and model, and how to report."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import attrs

from meshllm_dsl.codes import E0202, E0401
from meshllm_dsl.diagnostics import Diagnostic, Label, Suggestion, insert, replace, typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.names import ranges
from meshllm_dsl.front.resolve import Resolver
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import Leaf, MeshIR, ModelIR, Placement


@attrs.define
class _Match:
    """A placement source (a shard rule or a layout entry) and the blocks it covers for one leaf."""

    placement: Placement
    span: Span | None
    blocks: frozenset[int] | None  # None: every block (or a top-level leaf)
    text: str


class PlanContext(Resolver):
    def __init__(self, decl: ast.PlanDecl, mesh: MeshIR, model: ModelIR, diags: list[Diagnostic],
                 per_host: int | None = None) -> None:
        super().__init__(diags)
        self.per_host = per_host  # devices in one host of the mesh's device profile (None: unknown)
        self.decl = decl
        self.mesh = mesh
        self.model = model
        self.failed = False
        self.reported: set[tuple[int, str]] = set()  # divisibility errors already given, per rule
        self.by_leaf: dict[Leaf, list[_Match]] = {}  # every rule's matches (set by placements)
        self.claimed: set[Leaf] = set()  # leaves matched by a rule that was rejected
        # Leaves a misspelt rule was meant to place -> the index of its E0502 in `diagnostics`: their
        # "placed by no rule" follows from that typo, so it is a note there, not an E0501 of its own.
        self.folded: dict[Leaf, int] = {}
        self.unplaced = False  # some parameter is placed by no rule (E0501): its layout is unknown
        self.ambiguous = False  # some leaf is matched by two rules (E0503): its layout is unknown
        self.bad_settings: set[str] = set()  # plan settings given but rejected: checks that read them stay quiet
        self.seq_axes: tuple[str, ...] = ()  # sequence parallelism over these axes (`layout { seq -> T }`)
        self.seq_entry: ast.LayoutEntry | None = None
        # Context parallelism over these axes (`layout { seq -> C }`, C splitting no weight): checker/memory.py
        self.context_axes: tuple[str, ...] = ()
        # Expert parallelism over these axes (`layout { experts -> D }` or `shard PATH expert(D)`)
        self.expert_axes: tuple[str, ...] = ()
        self.expert_entry: ast.LayoutEntry | ast.ShardStmt | None = None

    def error(self, code: str, message: str, span: Span | None, **kw: object) -> None:
        if not code.startswith("W"):
            self.failed = True
        super().error(code, message, span, **kw)

    def error_count(self) -> int:
        return sum(d.is_error for d in self.diagnostics)

    def warn(self, code: str, message: str, span: Span | None, **kw: object) -> None:
        super().error(code, message, span, **kw)

    def axis_label(self, name: str) -> tuple[Label, ...]:
        axis = self.mesh.axis(name)
        if axis is None or axis.span is None:
            return ()
        return (Label(axis.span, f"`{name}` = {axis.size} declared here"),)

    def check_axes(self, names: Sequence[ast.Name], what: str) -> tuple[str, ...] | None:
        """Validate a list of axis names: each declared on the mesh, none twice.

        The result is in mesh order, whatever order the spec lists them in: a tensor split over
        several axes is chunked by the flattened mesh coordinate, and torch orders a group's
        members by global rank, so only mesh order makes chunk index and group rank agree.
        """
        out: list[str] = []
        ok = True
        for n in names:
            if self.mesh.axis(n.value) is None:
                self.error(E0202, f"unknown mesh axis `{n.value}`", n.span, label=f"not an axis of `{self.mesh.name}`",
                           **typo(n.span, n.value, [a.name for a in self.mesh.axes]))
                ok = False
            elif n.value in out:
                self.error(E0401, f"mesh axis `{n.value}` is used twice in {what}", n.span, label="used again",
                           help="a tensor dim can be split over an axis once; list each axis once")
                ok = False
            else:
                out.append(n.value)
        order = [a.name for a in self.mesh.axes]
        return tuple(sorted(out, key=order.index)) if ok else None

    def add_statement(self, stmt: str) -> tuple[Suggestion, ...]:
        """Inserting `stmt` on a line of its own after the plan's last `shard` rule (none without one:
        where a plan's first rule goes is the author's choice)."""
        shards = [s for s in self.decl.body if isinstance(s, ast.ShardStmt) and s.span is not None]
        if not shards:
            return ()
        anchor = shards[-1].span
        assert anchor is not None
        line = anchor.source.line_text(anchor.line)
        indent = line[: len(line) - len(line.lstrip())]
        return insert(anchor, True, f"\n{indent}{stmt}", f"Add `{stmt}`")

    def resize_axis(self, axes: Sequence[str], sizes: Sequence[int]) -> tuple[Suggestion, ...]:
        """Setting the one mesh axis `axes` names to each of `sizes`, at its declaration (`tensor = 8`).
        A split over several axes has no single size to change."""
        axis = self.mesh.axis(axes[0]) if len(axes) == 1 else None
        if axis is None or axis.span is None:
            return ()
        m = re.fullmatch(r"(\s*\w+\s*=\s*)(\d+)\s*", axis.span.text)
        if m is None:
            return ()
        start = axis.span.start + len(m[1])
        number = axis.span.source.span(start, start + len(m[2]))
        return tuple(s for v in sizes for s in replace(number, str(v), f"Set `{axis.name} = {v}`"))

    def single(self, kind: type, what: str):  # type: ignore[no-untyped-def]
        """The plan's one statement of `kind` (or None); a repeat of it is an error pointing at both."""
        stmts = [s for s in self.decl.body if isinstance(s, kind)]
        for extra in stmts[1:]:
            self.repeated(what, extra.span, stmts[0].span)
        return stmts[0] if stmts else None


class _Silent:
    def error(self, code: str, message: str, span: Span | None, **kw: object) -> None:
        pass


def _seg_matches(seg: ast.PathSegment, name: str) -> bool:
    if seg.kind == "star":
        return True
    if seg.kind in ("name", "alt"):
        return name in seg.names
    return False


def _blocks_text(blocks: Iterable[int]) -> str:
    """Block indices as a path segment: `3` or `{0-3,5}`."""
    xs = list(blocks)
    if not xs:
        return "{}"
    return str(xs[0]) if len(xs) == 1 else "{" + ranges(xs) + "}"


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)
