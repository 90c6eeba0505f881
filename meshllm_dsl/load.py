"""Files -> declarations: parse a file and everything it includes, plus the shipped prelude.

Includes resolve relative to the including file, then to the shipped standard library. A missing
file or an include cycle is a diagnostic (E0103); syntax errors in one file do not stop the others.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import attrs

from meshllm_dsl import ast
from meshllm_dsl.diagnostics import Diagnostic, SpecError
from meshllm_dsl.parser import parse_source
from meshllm_dsl.source import SourceFile

PRELUDE = "families.mesh"


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
    return Path(str(resources.files("meshllm_dsl") / "stdlib"))


@functools.lru_cache(maxsize=1)
def _prelude() -> tuple[ast.Item, ...]:
    # Shown as `<stdlib>/families.mesh` in diagnostics: the install location differs between machines
    # and would make rendered diagnostics (and their goldens) depend on where meshllm is installed.
    text = (stdlib_dir() / PRELUDE).read_bytes().decode("utf-8", errors="replace")
    return parse_source(SourceFile(f"<stdlib>/{PRELUDE}", text)).items


def load(path: str | Path, text: str | None = None) -> Declarations:
    decls = Declarations(prelude=list(_prelude()))
    root = SourceFile(str(path), text) if text is not None else _read(path, decls)
    if root is None:
        return decls
    decls.root = root
    _load_into(root, decls, stack=[])
    return decls


def _read(path: str | Path, decls: Declarations, span: object = None) -> SourceFile | None:
    try:
        return SourceFile.read(path)
    except OSError as err:
        decls.diagnostics.append(
            Diagnostic(
                "E0103",
                f"cannot read `{path}`: {err.strerror or err}",
                span,  # type: ignore[arg-type]
                label="included here" if span is not None else "",
                help="check the path; includes are relative to the including file",
            )
        )
        return None


def _load_into(source: SourceFile, decls: Declarations, stack: list[str]) -> None:
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
        target = _resolve_include(source, item.path.value)
        if target is None:
            decls.diagnostics.append(
                Diagnostic(
                    "E0103",
                    f"included file `{item.path.value}` not found",
                    item.path.span,
                    label="no such file",
                    help=f"looked next to {source.path} and in the standard library ({', '.join(sorted(p.name for p in stdlib_dir().glob('*.mesh')))})",
                )
            )
            continue
        if str(target.resolve()) in stack:
            decls.diagnostics.append(
                Diagnostic(
                    "E0103",
                    f"include cycle: `{item.path.value}` includes this file again",
                    item.path.span,
                    label="cycle closes here",
                    help="remove one of the includes; shared declarations belong in a third file",
                )
            )
            continue
        if target.name == PRELUDE and target.parent == stdlib_dir():
            continue  # the prelude is always loaded
        if any(Path(s.path).resolve() == target.resolve() for s in decls.sources):
            continue  # a file included twice (a diamond) declares its items once
        included = _read(target, decls, item.path.span)
        if included is not None:
            _load_into(included, decls, stack)


def _resolve_include(source: SourceFile, name: str) -> Path | None:
    base = Path(source.path).parent if source.path != "<string>" else Path.cwd()
    for candidate in (base / name, stdlib_dir() / name):
        if candidate.is_file():
            return candidate
    return None
