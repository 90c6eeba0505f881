"""Structured diagnostics and their rustc-style rendering.

Every problem the front end finds is a `Diagnostic` with a stable code, a primary span, optional
secondary labels (a second place involved, such as where an axis was declared) and a `help` line
that names concrete valid alternatives. Where the help proposes a concrete change, the diagnostic also
carries it as data (`suggestions`, as rustc's): editors apply those edits and never parse the help.
Rendering is separate from finding, so tools can ask for JSON.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs

from meshllm_dsl.codes import CODES
from meshllm_dsl.front.names import closest, did_you_mean
from meshllm_dsl.front.source import Span


class Severity(enum.Enum):
    ERROR = "error"
    WARNING = "warning"


@attrs.frozen
class Label:
    span: Span
    message: str


class Applicability(enum.Enum):
    """How sure a suggestion is, with rustc's names: a tool may apply MachineApplicable ones unasked."""

    MACHINE_APPLICABLE = "MachineApplicable"  # the fix, and it removes the diagnostic
    MAYBE_INCORRECT = "MaybeIncorrect"  # a plausible fix (a guessed name, one size of several)
    HAS_PLACEHOLDERS = "HasPlaceholders"  # the edit holds text the user must fill in
    UNSPECIFIED = "Unspecified"


@attrs.frozen
class Edit:
    """Replace the text under `span` with `text`; an empty span inserts."""

    span: Span
    text: str


@attrs.frozen
class Suggestion:
    message: str  # what applying it does, as an editor's action title: "Replace `tensr` with `tensor`"
    edits: tuple[Edit, ...]
    applicability: Applicability = Applicability.MAYBE_INCORRECT

    def apply(self, text: str) -> str:
        """`text` (the text of the edits' file) with every edit applied."""
        for e in sorted(self.edits, key=lambda e: (e.span.start, e.span.end), reverse=True):
            text = text[: e.span.start] + e.text + text[e.span.end :]
        return text


def replace(span: Span | None, text: str, message: str | None = None,
            applicability: Applicability = Applicability.MAYBE_INCORRECT) -> tuple[Suggestion, ...]:
    """The one suggestion that puts `text` where `span` is (none without a span, or when it is there)."""
    if span is None or span.text == text:
        return ()
    return (Suggestion(message or f"Replace `{span.text}` with `{text}`", (Edit(span, text),), applicability),)


def insert(span: Span | None, at_end: bool, text: str, message: str,
           applicability: Applicability = Applicability.MAYBE_INCORRECT) -> tuple[Suggestion, ...]:
    """The one suggestion that inserts `text` at the start or end of `span`."""
    if span is None:
        return ()
    at = span.end if at_end else span.start
    return (Suggestion(message, (Edit(span.source.span(at, at), text),), applicability),)


def make_rule(span: Span | None, rule: str,
              applicability: Applicability = Applicability.MAYBE_INCORRECT) -> tuple[Suggestion, ...]:
    """Rewriting the sharding rule written at `span` (`row(tensor)`) as `rule`. A placement that
    came from a layout entry (`ffn -> tensor`) has that entry's span, which no rule replaces."""
    if span is None or not re.fullmatch(r"\w+\s*(\([^()]*\))?", span.text):
        return ()
    return replace(span, rule, f"Make it `{rule}`", applicability)


def typo(span: Span | None, name: str, candidates: Iterable[str]) -> dict[str, object]:
    """`help=` and `suggestions=` for a misspelt name at `span`: the did-you-mean line, and replacing
    the name with the closest candidate."""
    options = list(candidates)
    meant = closest(name, options)
    return {"help": did_you_mean(name, options),
            "suggestions": replace(span, meant) if meant is not None and span is not None and span.text == name else ()}


def _registered(_d: object, _a: object, code: str) -> None:
    # The emission sites use the constants of codes.py; a code made any other way must still be one.
    if code not in CODES:
        raise ValueError(f"diagnostic code {code!r} is not in meshllm_dsl.codes.CODES")


@attrs.frozen
class Diagnostic:
    code: str = attrs.field(validator=_registered)
    message: str
    span: Span | None
    label: str = ""
    secondary: tuple[Label, ...] = ()
    help: str | None = None
    note: str | None = None
    suggestions: tuple[Suggestion, ...] = ()

    @property
    def severity(self) -> Severity:
        return Severity.WARNING if self.code.startswith("W") else Severity.ERROR

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def to_json(self) -> dict[str, object]:
        def where(span: Span) -> dict[str, object]:
            end_line, end_col = span.source.position(span.end)
            return {
                "file": span.file,
                "line": span.line,
                "column": span.column,
                "end_line": end_line,
                "end_column": end_col,
            }

        return {
            "code": self.code,
            "severity": self.severity.value,
            "message": self.message,
            "span": where(self.span) if self.span else None,
            "label": self.label,
            "secondary": [{"message": s.message, **where(s.span)} for s in self.secondary],
            "help": self.help,
            "note": self.note,
            "suggestions": [
                {"message": s.message, "applicability": s.applicability.value,
                 "edits": [{**where(e.span), "replacement": e.text} for e in s.edits]}
                for s in self.suggestions
            ],
        }


class Reporter(Protocol):
    """Where a pass sends the errors it finds (the resolver, the checker's context, a silent sink):
    what the layer kinds' records and the layout algebra are handed, so they need not know which."""

    def error(self, code: str, message: str, span: Span | None, **kw: object) -> None: ...


class SpecError(Exception):
    """Raised by the API when a spec has errors; carries every diagnostic found."""

    def __init__(self, diagnostics: Sequence[Diagnostic]) -> None:
        self.diagnostics = tuple(diagnostics)
        super().__init__(render_all(self.diagnostics))


# A snippet shows at most this many characters of a line and this many lines of a span, as rustc
# does: a 5,000-digit literal or a span over a whole model must not flood the terminal.
_WIDTH = 160
_LINES = 6


def _window(text: str, start: int, end: int) -> tuple[str, int]:
    """`text` cut to _WIDTH characters around the 1-based columns [start, end), and the number of
    columns the cut moved them left by ("..." marks each cut side)."""
    if len(text) <= _WIDTH:
        return text, 0
    left = max(0, min(start - 1 - 20, len(text) - _WIDTH))
    prefix = "..." if left > 0 else ""
    suffix = "..." if left + _WIDTH < len(text) else ""
    return prefix + text[left : left + _WIDTH] + suffix, left - len(prefix)


def _snippet(span: Span, label: str, mark: str, gutter: int) -> list[str]:
    """Source lines under `span` with `mark` characters under the exact columns."""
    source = span.source
    first_line, first_col = source.position(span.start)
    last_line, last_col = source.position(max(span.start, span.end - 1) if span.end > span.start else span.start)
    pad = " " * gutter
    out: list[str] = []
    lines = list(range(first_line, last_line + 1))
    if len(lines) > _LINES:  # the first lines and the last: where the span starts and ends
        lines = lines[: _LINES - 2] + [0] + lines[-1:]
    for line in lines:
        if line == 0:
            out.append(f"{pad} | ...")
            continue
        text = source.line_text(line).replace("\t", " ")
        start = first_col if line == first_line else 1
        if line == last_line:
            end = last_col + (1 if span.end > span.start else 0)
        else:
            end = len(text) + 1
        text, shift = _window(text, start, end)
        start, end = max(1, start - shift), min(end - shift, len(text) + 1)
        out.append(f"{str(line).rjust(gutter)} | {text}")
        width = max(1, end - start)
        marks = " " * (start - 1) + mark * width
        if line == last_line and label:
            marks += " " + label
        out.append(f"{pad} | {marks.rstrip()}")
    return out


def render(d: Diagnostic) -> str:
    """One diagnostic in rustc's layout."""
    lines = [f"{d.severity.value}[{d.code}]: {d.message}"]
    spans = [s for s in [d.span, *(lab.span for lab in d.secondary)] if s is not None]
    gutter = max((len(str(s.source.position(s.end)[0])) for s in spans), default=1)
    pad = " " * gutter
    if d.span is not None:
        lines.append(f"{pad}--> {d.span}")
        lines.append(f"{pad} |")
        lines.extend(_snippet(d.span, d.label, "^", gutter))
    for lab in d.secondary:
        if d.span is None or lab.span.file != d.span.file:
            if d.span is not None:
                lines.append(f"{pad} |")
            lines.append(f"{pad}::: {lab.span}")
        lines.append(f"{pad} |")
        lines.extend(_snippet(lab.span, lab.message, "-", gutter))
    if d.span is not None or d.secondary:
        lines.append(f"{pad} |")
    if d.note:
        lines.append(f"{pad} = note: {d.note}")
    if d.help:
        lines.append(f"{pad} = help: {d.help}")
    return "\n".join(lines)


def sort_key(d: Diagnostic) -> tuple[str, int, int, str]:
    if d.span is None:
        return ("", 0, 0, d.code)
    return (d.span.file, d.span.start, d.span.end, d.code)


def render_all(diagnostics: Iterable[Diagnostic]) -> str:
    ds = sorted(diagnostics, key=sort_key)
    body = "\n\n".join(render(d) for d in ds)
    errors = sum(d.is_error for d in ds)
    warnings = len(ds) - errors
    summary = []
    if errors:
        summary.append(f"{errors} error{'s' if errors != 1 else ''}")
    if warnings:
        summary.append(f"{warnings} warning{'s' if warnings != 1 else ''}")
    if not ds:
        return ""
    return body + "\n\n" + ", ".join(summary) + " found\n"


def to_json(diagnostics: Iterable[Diagnostic]) -> str:
    return json.dumps([d.to_json() for d in sorted(diagnostics, key=sort_key)], indent=2)
