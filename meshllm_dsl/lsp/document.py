"""What the language server knows about one open document, computed by the front end itself.

`Document(path, text)` runs the same load -> resolve -> check pipeline as `meshc check` (so the
diagnostics are exactly the command's), then indexes every name occurrence of the file, its includes
and the prelude by the symbol it means (a mesh, an axis of a mesh, a family parameter, a layer of a
family or model, ...). Hover, definition, references and completion are look-ups in that index and in
the checked IR (shapes, placements, the planner's memory). Nothing here imports pygls, so the logic is
testable and reusable; positions are 0-based lines and UTF-16 columns, as LSP counts them.

The features that read it (hover.py, actions.py) sit above this module; analysis.py joins them to
the document as the `Analysis` the server keeps.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from pathlib import Path

import attrs

from meshllm_dsl.checker import CheckResult, check_declarations
from meshllm_dsl.checker.paths import match_path
from meshllm_dsl.codes import E0101, E0102
from meshllm_dsl.diagnostics import Diagnostic, SpecError
from meshllm_dsl.front import ast
from meshllm_dsl.front.load import Declarations, load, stdlib_dir
from meshllm_dsl.front.parser import parse_source
from meshllm_dsl.front.source import SourceFile, Span
from meshllm_dsl.ir import ModelIR, Placement, PlanIR, Repeat, Tensor, Unit

SYNTAX_CODES = (E0101, E0102)
DECL_KEYWORDS = ("include", "mesh", "family", "model", "plan", "device")
_TOP_DECL = re.compile(r"^(?:include|mesh|family|model|plan|device)\b", re.MULTILINE)

Pos = tuple[int, int]  # (0-based line, UTF-16 column)


# ---------------------------------------------------------------- positions


def utf16_len(s: str) -> int:
    return len(s.encode("utf-16-le")) // 2


class LineIndex:
    """Offset <-> LSP position for one text (columns in UTF-16 code units, as LSP's default)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def position(self, offset: int) -> Pos:
        import bisect

        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self.starts, offset) - 1
        return line, utf16_len(self.text[self.starts[line] : offset])

    def offset(self, pos: Pos) -> int:
        line, col = pos
        if line >= len(self.starts):
            return len(self.text)
        start = self.starts[max(line, 0)]
        end = self.text.find("\n", start)
        end = len(self.text) if end < 0 else end
        units = 0
        i = start
        while i < end and units < col:
            units += 2 if ord(self.text[i]) > 0xFFFF else 1
            i += 1
        return i


def file_path(span_file: str) -> str:
    """Where a span's file is on disk: the prelude is shown as `<stdlib>/...` in diagnostics."""
    if span_file.startswith("<stdlib>/"):
        return str(stdlib_dir() / span_file.split("/", 1)[1])
    return span_file


@attrs.frozen
class Loc:
    file: str
    start: Pos
    end: Pos


_INDEXES: dict[int, tuple[SourceFile, LineIndex]] = {}


def _index(source: SourceFile) -> LineIndex:
    # Spans share their SourceFile, so one LineIndex per file serves every span of an analysis.
    hit = _INDEXES.get(id(source))
    if hit is None or hit[0] is not source:
        if len(_INDEXES) > 64:
            _INDEXES.clear()
        hit = (source, LineIndex(source.text))
        _INDEXES[id(source)] = hit
    return hit[1]


def span_loc(span: Span) -> Loc:
    index = _index(span.source)
    return Loc(file_path(span.file), index.position(span.start), index.position(span.end))


# ---------------------------------------------------------------- symbols and their occurrences


@attrs.frozen
class Occ:
    """One name in the text, the symbol it means, and whether this is where it is declared."""

    span: Span
    key: tuple[str, ...]
    decl: bool = False
    node: object = attrs.field(default=None, eq=False)
    context: object = attrs.field(default=None, eq=False)  # the declaration it sits in


def _layer_names(body: Sequence[ast.LayerStmt], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for s in body:
        out.add(prefix + s.name.value)
        if isinstance(s, ast.RepeatDecl):
            out |= _layer_names(s.body, prefix + s.name.value + ".")
    return out


class SymbolIndex:
    """Every occurrence of every symbol in a set of declarations (user files and the prelude)."""

    def __init__(self, items: Sequence[ast.Item], prelude: Sequence[ast.Item]) -> None:
        self.families: dict[str, ast.FamilyDecl] = {}
        for it in [*prelude, *items]:
            if isinstance(it, ast.FamilyDecl):
                self.families[it.name.value] = it
        self.models = {it.name.value: it for it in items if isinstance(it, ast.ModelDecl)}
        self.meshes = {it.name.value: it for it in items if isinstance(it, ast.MeshDecl)}
        self.devices = {it.name.value: it for it in items if isinstance(it, ast.DeviceDecl)}
        self.plans = {it.name.value: it for it in items if isinstance(it, ast.PlanDecl)}
        self.occs: list[Occ] = []
        for it in [*prelude, *items]:
            self._item(it)

    def add(self, node: ast.Name | ast.StrLit | ast.PathSegment | None, key: tuple[str, ...], decl: bool = False,
            context: object = None) -> None:
        if node is not None and node.span is not None:
            self.occs.append(Occ(node.span, key, decl, node, context))

    def owner(self, model: str) -> str:
        """Whose body declares a model's layers: its family's, or its own."""
        md = self.models.get(model)
        if md is not None and md.family is not None:
            return "family:" + md.family.value
        return "model:" + model

    def _item(self, it: ast.Item) -> None:
        if isinstance(it, ast.Include):
            self.add(it.path, ("file", it.path.value), context=it)
        elif isinstance(it, ast.DeviceDecl):
            self.add(it.name, ("device", it.name.value), True, it)
        elif isinstance(it, ast.MeshDecl):
            self.add(it.name, ("mesh", it.name.value), True, it)
            for a in it.axes:
                self.add(a.name, ("axis", it.name.value, a.name.value), True, it)
            for s in it.settings:
                self.add(s.name, ("setting", "mesh", s.name.value), context=it)
                if s.name.value == "device" and isinstance(s.value, ast.Name):
                    self.add(s.value, ("device", s.value.value), context=it)
        elif isinstance(it, ast.FamilyDecl):
            self.add(it.name, ("family", it.name.value), True, it)
            params = {p.name.value for p in it.params}
            for p in it.params:
                self.add(p.name, ("param", it.name.value, p.name.value), True, it)
                for n in ast.names_in(p.default):
                    if n.value in params:
                        self.add(n, ("param", it.name.value, n.value), context=it)
            self._body(it.body, "family:" + it.name.value, lambda n: ("param", it.name.value, n) if n in params else None, it)
        elif isinstance(it, ast.ModelDecl):
            self.add(it.name, ("model", it.name.value), True, it)
            if it.family is not None:
                fam = it.family.value
                self.add(it.family, ("family", fam), context=it)
                for s in it.settings:
                    self.add(s.name, ("param", fam, s.name.value), context=it)
                    for n in ast.names_in(s.value):
                        self.add(n, ("param", fam, n.value), context=it)
            else:
                dims = {s.name.value for s in it.settings}
                for s in it.settings:
                    self.add(s.name, ("dim", it.name.value, s.name.value), True, it)
                    for n in ast.names_in(s.value):
                        if n.value in dims:
                            self.add(n, ("dim", it.name.value, n.value), context=it)
                self._body(it.body, "model:" + it.name.value,
                           lambda n: ("dim", it.name.value, n) if n in dims else None, it)
        elif isinstance(it, ast.PlanDecl):
            self._plan(it)

    def _body(self, body: Sequence[ast.LayerStmt], owner: str, ref: object, ctx: object, prefix: str = "") -> None:
        layers = _layer_names(body)
        for s in body:
            self.add(s.name, ("layer", owner, prefix + s.name.value), True, ctx)
            if isinstance(s, ast.RepeatDecl):
                for n in ast.names_in(s.count):
                    key = ref(n.value)  # type: ignore[operator]
                    if key:
                        self.add(n, key, context=ctx)
                self._body(s.body, owner, ref, ctx, prefix + s.name.value + ".")
                continue
            self.add(s.call.func, ("primitive", s.call.func.value), context=ctx)
            exprs = [*s.call.args, *(kw.value for kw in s.call.kwargs)]
            for e in exprs:
                for n in ast.names_in(e):
                    key = ref(n.value)  # type: ignore[operator]
                    if key:
                        self.add(n, key, context=ctx)
                    elif n.value in layers:
                        self.add(n, ("layer", owner, prefix + n.value), context=ctx)

    def _plan(self, p: ast.PlanDecl) -> None:
        self.add(p.name, ("plan", p.name.value), True, p)
        mesh, model = p.mesh.value, p.model.value
        self.add(p.mesh, ("mesh", mesh), context=p)
        self.add(p.model, ("model", model), context=p)
        owner = self.owner(model)
        md = self.models.get(model)
        fam = md.family.value if md is not None and md.family is not None else None

        def axis(n: ast.Name) -> None:
            self.add(n, ("axis", mesh, n.value), context=p)

        for s in p.body:
            if isinstance(s, ast.Setting):
                self.add(s.name, ("setting", "plan", s.name.value), context=p)
            elif isinstance(s, ast.ShardStmt):
                prefix: list[str] = []
                for seg in s.path.segments:
                    if seg.kind == "name":
                        prefix.append(seg.names[0])
                        self.add(seg, ("layer", owner, ".".join(prefix)), context=p)
                    elif seg.kind == "alt":
                        break
                self.add(s.rule.name, ("rule", s.rule.name.value), context=p)
                for n in s.rule.axes:
                    axis(n)
            elif isinstance(s, ast.LossStmt):
                self.add(s.rule.name, ("rule", s.rule.name.value), context=p)
                for n in s.rule.axes:
                    axis(n)
            elif isinstance(s, ast.LayoutStmt):
                for e in s.entries:
                    self.add(e.dim, ("param", fam, e.dim.value) if fam else ("dim", model, e.dim.value), context=p)
                    for n in e.axes:
                        axis(n)
            elif isinstance(s, ast.StagesStmt):
                axis(s.axis)
                for entry in s.entries:
                    for stage_item in entry.items:
                        self.add(stage_item.name, ("layer", owner, stage_item.name.value), context=p)
            elif isinstance(s, ast.ScheduleStmt):
                self.add(s.name, ("schedule", s.name.value), context=p)
            elif isinstance(s, ast.OptimizerStmt):
                self.add(s.name, ("optimizer", s.name.value), context=p)
                if s.zero is not None:
                    for n in s.zero.axes:
                        axis(n)

    def at(self, file: str, offset: int) -> list[Occ]:
        """Occurrences in `file` whose span touches `offset`, smallest first."""
        hits = [o for o in self.occs if o.span.file == file and o.span.start <= offset <= o.span.end]
        return sorted(hits, key=lambda o: o.span.end - o.span.start)

    def of(self, key: tuple[str, ...]) -> list[Occ]:
        return [o for o in self.occs if o.key == key]


# ---------------------------------------------------------------- the analysis of one document


@attrs.frozen
class Fix:
    """A code action: a diagnostic's suggestion with its edits as LSP locations."""

    title: str
    edits: tuple[tuple[Loc, str], ...]  # (where, new text), applied together
    preferred: bool = False  # machine-applicable: the one fix an editor may apply unasked


class Document:
    """Diagnostics (exactly `meshc check`'s) and the symbol index of one document's text."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text
        self.lines = LineIndex(text)
        self.decls: Declarations = load(path, text)
        self.result: CheckResult = check_declarations(self.decls)
        self.diagnostics: tuple[Diagnostic, ...] = self.result.diagnostics
        self.syntax_error = next((d for d in self.diagnostics if d.code in SYNTAX_CODES and d.span is not None
                                  and d.span.file == path), None)
        decls, result = self.decls, self.result
        blanked = None
        if self.syntax_error is not None:
            # Mid-edit: the file does not parse. Blank the declaration the error sits in (keeping every
            # offset) and analyse the rest, so outline, hover and completion keep working; the
            # published diagnostics stay the syntax error alone, as `meshc check` reports it.
            blanked = _blank_item(text, self.syntax_error.span.start)  # type: ignore[union-attr]
            if blanked is not None:
                try:
                    decls = load(path, blanked)
                    result = check_declarations(decls)
                except RecursionError:
                    pass
        self.sem_decls, self.sem_result = decls, result
        # `load` consumes the include statements; parse the root again (only when it has any) to
        # link them to their files.
        self.includes: list[ast.Include] = []
        if "include" in text:
            with contextlib.suppress(SpecError, RecursionError):
                self.includes = [it for it in parse_source(SourceFile(path, blanked or text)).items
                                 if isinstance(it, ast.Include)]
        self.index = SymbolIndex([*self.includes, *decls.items], decls.prelude)

    @property
    def usable(self) -> bool:
        """Whether the semantic view holds the root file's declarations (parsed, or recovered)."""
        return any(s.path == self.path for s in self.sem_decls.sources) and bool(self.sem_decls.items) or not self.text.strip()

    # -- diagnostics
    def diagnostics_by_file(self) -> dict[str, list[Diagnostic]]:
        out: dict[str, list[Diagnostic]] = {self.path: []}
        for s in self.decls.sources:
            out.setdefault(s.path, [])
        for d in self.diagnostics:
            out.setdefault(d.span.file if d.span is not None else self.path, []).append(d)
        return out

    # -- symbols
    def symbols(self) -> list[tuple[str, str, Span, Span, list[tuple[str, str, Span, Span]]]]:
        """(kind, name, whole span, name span, children) for every declaration of this file."""
        out = []
        items = sorted([*self.includes, *self.sem_decls.items], key=lambda it: it.span.start if it.span else 0)
        for it in items:
            if it.span is None or it.span.file != self.path:
                continue
            children: list[tuple[str, str, Span, Span]] = []
            if isinstance(it, ast.Include):
                out.append(("include", it.path.value, it.span, it.path.span or it.span, children))
                continue
            name = it.name
            if isinstance(it, ast.MeshDecl):
                children = [_child("axis", a.name, a.span) for a in it.axes]
            elif isinstance(it, ast.ModelDecl | ast.FamilyDecl):
                children = [_child("layer", st.name, st.span) for st in it.body]
                if isinstance(it, ast.FamilyDecl):
                    children = [_child("param", p.name, p.span) for p in it.params] + children
            elif isinstance(it, ast.PlanDecl):
                for s in it.body:
                    if isinstance(s, ast.ShardStmt) and s.span is not None:
                        children.append(("shard", f"shard {s.path}", s.span, s.path.span or s.span))
                    elif isinstance(s, ast.StagesStmt) and s.span is not None:
                        children.append(("stages", f"stages over {s.axis.value}", s.span, s.axis.span or s.span))
            kind = type(it).__name__.removesuffix("Decl").lower()
            out.append((kind, name.value, it.span, name.span or it.span, children))
        return out

    # -- definition and references
    def occurrence(self, offset: int) -> Occ | None:
        hits = self.index.at(self.path, offset)
        return hits[0] if hits else None

    def definition(self, offset: int) -> list[Loc]:
        occ = self.occurrence(offset)
        if occ is None:
            return []
        if occ.key[0] == "file":
            target = _include_target(self.path, occ.key[1])
            return [Loc(str(target), (0, 0), (0, 0))] if target else []
        return [span_loc(o.span) for o in self.index.of(occ.key) if o.decl]

    def references(self, offset: int, include_declaration: bool = True) -> list[Loc]:
        occ = self.occurrence(offset)
        if occ is None:
            return []
        return [span_loc(o.span) for o in self.index.of(occ.key) if include_declaration or not o.decl]

    # -- helpers for the features
    def plan_decl_at(self, offset: int) -> ast.PlanDecl | None:
        for it in self.sem_decls.items:
            if isinstance(it, ast.PlanDecl) and it.span is not None and it.span.file == self.path \
                    and it.span.start <= offset <= it.span.end:
                return it
        return None

    def plan_ir(self, decl: ast.PlanDecl) -> PlanIR | None:
        return self.sem_result.plans.get(decl.name.value)

    def model_ir(self, name: str) -> ModelIR | None:
        return self.sem_result.models.get(name)


def _child(kind: str, name: ast.Name, whole: Span | None) -> tuple[str, str, Span, Span]:
    assert name.span is not None  # names always come from a token
    return kind, name.value, whole or name.span, name.span


def _include_target(path: str, name: str) -> Path | None:
    base = Path(path).parent
    for candidate in (base / name, stdlib_dir() / name):
        if candidate.is_file():
            return candidate
    return None


def _blank_item(text: str, error_at: int) -> str | None:
    """`text` with the top-level declaration around `error_at` replaced by spaces (newlines kept).

    A declaration starts at a line that begins with a declaration keyword; the broken one runs from
    the last such line at or before the error to the next one after it.
    """
    starts = [m.start() for m in _TOP_DECL.finditer(text)]
    before = [s for s in starts if s <= error_at]
    after = [s for s in starts if s > error_at]
    if not before and not after:
        return None
    lo = before[-1] if before else 0
    hi = after[0] if after else len(text)
    if hi <= lo:
        return None
    return text[:lo] + re.sub(r"[^\n]", " ", text[lo:hi]) + text[hi:]


# ---------------------------------------------------------------- what a shard path matches


@attrs.frozen
class Match:
    path: str  # e.g. blocks.{0-79}.attn.q
    unit: Unit
    tensors: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # name, global, local
    placement: Placement
    collectives: tuple[str, ...]


def shard_matches(plan: PlanIR, decl: ast.PlanDecl, path: ast.Path, layer: bool = False) -> list[Match]:
    """Every leaf `path` matches in a checked plan, with shapes and the collectives of its unit
    (``layer``: every leaf of the layers it names, as `expert(D)` places them)."""
    from meshllm_dsl.front.names import ranges
    from meshllm_dsl.views.explain import _collective

    units = {id(leaf): (item, unit) for item, unit, leaf in plan.model.leaves()}
    out: list[Match] = []
    for leaf, blocks in match_path(path, plan.model, layer=layer):
        item, unit = units[id(leaf)]
        if isinstance(item, Repeat):
            # one row per block class (blocks sharing every placement), not per block: a repeat may
            # have thousands of blocks
            wanted = set(blocks) if blocks is not None else None
            groups: dict[tuple[Placement, tuple[str, ...]], list[int]] = {}
            for cls in plan.classes_of(item.name):
                ids = [i for i in cls.indices if wanted is None or i in wanted]
                if not ids:
                    continue
                p = cls.placement(".".join(leaf.path))
                flow = dict(cls.flows).get(unit.name)
                colls = tuple(_collective(c) for c in flow.collectives) if flow else ()
                groups.setdefault((p, colls), []).extend(ids)
            for (p, colls), ids in groups.items():
                ids.sort()
                seg = str(ids[0]) if len(ids) == 1 else "{" + ranges(ids) + "}"
                name = f"{item.name}.{seg}." + ".".join(leaf.path)
                out.append(Match(name, unit, _tensors(plan, leaf.params, p), p, colls))
        else:
            p = plan.placement(".".join(leaf.path))
            flow = dict(plan.top_flows).get(unit.name)
            colls = tuple(_collective(c) for c in flow.collectives) if flow else ()
            out.append(Match(".".join(leaf.path), unit, _tensors(plan, leaf.params, p), p, colls))
    return out


def _tensors(plan: PlanIR, params: Sequence[Tensor], p: Placement) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    return tuple((t.name, t.shape, plan.local_shape(t, p)) for t in params)


def leaf_paths(model: ModelIR) -> list[str]:
    """Path patterns of every layer with parameters, as a `shard` rule names them."""
    out = []
    for item, _unit, leaf in model.leaves():
        out.append((f"{item.name}.*." if isinstance(item, Repeat) else "") + ".".join(leaf.path))
    return list(dict.fromkeys(out))


__all__ = ["DECL_KEYWORDS", "Document", "LineIndex", "Loc", "Occ",
           "SymbolIndex", "leaf_paths", "shard_matches", "span_loc"]
