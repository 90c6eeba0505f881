"""Files -> declarations: parse a file and everything it includes, plus the shipped prelude.

An include names a relative `.mesh` path; it resolves next to the including file, then in each
include directory (`meshc -I DIR`), then in the shipped standard library. Only regular `.mesh` files
under the size cap are read, so an include can never pull a secret, a device file or a dataset into
a diagnostic. A missing, refused or cyclic include is E0103; a file that is not UTF-8 text is E0104.
Syntax errors in one file do not stop the others.
"""

from __future__ import annotations

import contextvars
import functools
import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath

import attrs

from meshllm_dsl.codes import E0103, E0104
from meshllm_dsl.diagnostics import Diagnostic, Label, SpecError
from meshllm_dsl.front import ast
from meshllm_dsl.front.parser import parse_source
from meshllm_dsl.front.source import SourceFile, Span, UnreadableSpec

PRELUDE = "families.mesh"

# The include directories of the command being run (`meshc ... -I DIR`); a context variable so that
# every stage that loads the spec again (twin, planner, verify) sees the same ones without each
# threading a parameter through.
INCLUDE_DIRS: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar("INCLUDE_DIRS", default=())


@attrs.define
class Declarations:
    """Every top-level declaration visible from the root file, by kind, in source order."""

    root: SourceFile | None = None
    sources: list[SourceFile] = attrs.field(factory=list)
    items: list[ast.Item] = attrs.field(factory=list)  # user items, in include order
    prelude: list[ast.Item] = attrs.field(factory=list)
    diagnostics: list[Diagnostic] = attrs.field(factory=list)

    def user(self, kind: type) -> list:  # type: ignore[type-arg]
        return [i for i in self.items if isinstance(i, kind)]


def stdlib_dir() -> Path:
    # In the package root (what importlib.resources.files gives for an installed package, without
    # importing importlib.resources and zipfile at every start).
    return Path(__file__).parents[1] / "stdlib"


@functools.lru_cache(maxsize=1)
def _prelude() -> tuple[ast.Item, ...]:
    # Shown as `<stdlib>/families.mesh` in diagnostics: the install location differs between machines
    # and would make rendered diagnostics (and their goldens) depend on where meshllm is installed.
    text = (stdlib_dir() / PRELUDE).read_bytes().decode("utf-8", errors="replace")
    return parse_source(SourceFile(f"<stdlib>/{PRELUDE}", text)).items


def load(
    path: str | Path, text: str | None = None, include_dirs: Sequence[str | Path] | None = None
) -> Declarations:
    decls = Declarations(prelude=list(_prelude()))
    dirs = tuple(Path(d) for d in include_dirs) if include_dirs is not None else INCLUDE_DIRS.get()
    root = SourceFile(str(path), text) if text is not None else _read(path, decls)
    if root is None:
        return decls
    decls.root = root
    _load_into(root, decls, [], dirs)
    return decls


def read_spec(path: str | Path) -> SourceFile:
    """One spec file as text, or SpecError with E0104 (the one decoding every command shares)."""
    try:
        return SourceFile.read(path)
    except UnreadableSpec as err:
        raise SpecError([_unreadable(err, None)]) from None


def _read(path: str | Path, decls: Declarations, span: Span | None = None) -> SourceFile | None:
    try:
        return SourceFile.read(path)
    except UnreadableSpec as err:
        if err.source is not None:
            decls.sources.append(err.source)
        decls.diagnostics.append(_unreadable(err, span))
        return None


def _unreadable(err: UnreadableSpec, included_at: Span | None) -> Diagnostic:
    if err.source is None:  # nothing of the file is shown: it may not be a spec at all
        return Diagnostic(E0104, err.message, included_at, label="included here" if included_at else "", help=err.help)
    # Text with one bad byte: point at it, and at the include that brought the file in.
    secondary = () if included_at is None else (Label(included_at, "included here"),)
    where = err.source.span(err.offset, err.offset + 1)
    return Diagnostic(E0104, err.message, where, label="not UTF-8", secondary=secondary, help=err.help)


def _load_into(source: SourceFile, decls: Declarations, stack: list[str], dirs: tuple[Path, ...]) -> None:
    decls.sources.append(source)
    try:
        module = parse_source(source)
    except SpecError as err:
        decls.diagnostics.extend(err.diagnostics)
        return
    key = str(Path(source.path).resolve()) if source.path != "<string>" else source.path
    stack = [*stack, key]
    for item in module.items:
        if not isinstance(item, ast.Include):
            decls.items.append(item)
            continue
        refused = _refuse_include(item.path.value)
        if refused is not None:
            decls.diagnostics.append(Diagnostic(E0103, refused[0], item.path.span, label="refused", help=refused[1]))
            continue
        places = _include_places(source, dirs)
        target = _resolve_include(places, item.path.value)
        if target is None:
            stdlib = ", ".join(sorted(p.name for p in stdlib_dir().glob("*.mesh")))
            where = ", ".join(str(p) for p in places[:-1])
            decls.diagnostics.append(
                Diagnostic(
                    E0103,
                    f"included file `{item.path.value}` not found",
                    item.path.span,
                    label="no such file",
                    help=f"looked in {where} and in the standard library ({stdlib}); add a directory with -I DIR",
                )
            )
            continue
        try:
            real = target.resolve()
        except (OSError, RuntimeError):  # a symlink loop: reading it says so
            real = target
        if real.suffix != ".mesh":  # a symlink named x.mesh must lead to a spec too
            decls.diagnostics.append(Diagnostic(
                E0103, f"`{item.path.value}` leads to `{real}`, which is not a .mesh file",
                item.path.span, label="refused", help="only .mesh specs can be included"))
            continue
        if str(real) in stack:
            decls.diagnostics.append(
                Diagnostic(
                    E0103,
                    f"include cycle: `{item.path.value}` includes this file again",
                    item.path.span,
                    label="cycle closes here",
                    help="remove one of the includes; shared declarations belong in a third file",
                )
            )
            continue
        if target.name == PRELUDE and target.parent == stdlib_dir():
            continue  # the prelude is always loaded
        if any(Path(s.path).resolve() == real for s in decls.sources):
            continue  # a file included twice (a diamond) declares its items once
        included = _read(target, decls, item.path.span)
        if included is not None:
            _load_into(included, decls, stack, dirs)


def _refuse_include(name: str) -> tuple[str, str] | None:
    """(message, help) when an include path is not a relative path to a .mesh file."""
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        return (f"absolute include path `{name}`",
                "write the path relative to the including file, or pass the directory with -I DIR and include the name")
    if not name.endswith(".mesh") or "\0" in name:
        return (f"`{name}` is not a .mesh file", "only .mesh specs can be included")
    return None


def _include_places(source: SourceFile, dirs: tuple[Path, ...]) -> list[Path]:
    base = Path(source.path).parent if not source.path.startswith("<") else Path.cwd()
    return [base, *dirs, stdlib_dir()]


def _resolve_include(places: list[Path], name: str) -> Path | None:
    # The first place that has the name wins, whatever it is: reading it then says what is wrong
    # (a directory, a device, a FIFO) instead of "not found".
    for place in places:
        candidate = place / name
        if os.path.lexists(candidate):
            return candidate
    return None
