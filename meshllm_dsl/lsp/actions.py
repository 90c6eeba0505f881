"""Quick fixes: the diagnostics whose `help:` names a concrete edit, turned into that edit.

The checker's help lines are the single source of what to do; this module only reads them, so a
reworded help loses its quick fix but never produces a wrong one (each pattern also checks that the
text it replaces is what the help is about).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from meshllm_dsl.diagnostics import Diagnostic
from meshllm_dsl.lsp.analysis import Fix, Loc, span_loc

if TYPE_CHECKING:
    from meshllm_dsl.lsp.analysis import Analysis

_DID_YOU_MEAN = re.compile(r"did you mean `([^`]+)`\?")
_IDENT = re.compile(r"use a plain identifier such as `([^`]+)`")
_EXTEND = re.compile(r"extend it to `([^`]+)`")
_START_AT = re.compile(r"start this range at (\d+)")
_DIVISORS = re.compile(r"(?:use|e\.g\.) ((?:\d+, )*\d+(?: or \d+)?)")
_USE_SETTING = re.compile(r"use `(\w+) = (\d+)`")
_WRITE = re.compile(r"write `(zero [^`]+)`")
_ADD_SHARD = re.compile(r"add `(shard [^`]+)`")
_ADD_AFTER = re.compile(r"add `(\w+)` after `([^`]+)`")
_MAKE_RULE = re.compile(r"make `[^`]+` `(\w+(?:\([^`]*\))?)`")
_RULE_TEXT = re.compile(r"\w+(?:\s*\([^()]*\))?")
_RULE_CHOICES = re.compile(r"^use ((?:`\w+`, )*`\w+`(?: or `\w+`)?)$")
_WHOLE = re.compile(r"use a whole number such as (\d+)")
_LOSS = re.compile(r"use `loss (\w+)`")
_MISSING_BRACE = re.compile(r"`(\w+)` on line (\d+) starts a new declaration, but a block above it is still open")


def fixes(a: Analysis, d: Diagnostic) -> list[Fix]:
    out: list[Fix] = []
    help_ = d.help or ""
    span = d.span
    if span is None:
        return out
    here = span_loc(span)
    if m := _DID_YOU_MEAN.search(help_):
        out.append(Fix(f"Replace `{span.text}` with `{m[1]}`", here, m[1]))
    if m := _IDENT.search(help_):
        out.append(Fix(f"Rename to `{m[1]}`", here, m[1]))
    if m := _EXTEND.search(help_):
        out.append(Fix(f"Extend to `{m[1]}`", here, m[1]))
    if (m := _START_AT.search(help_)) and (rng := re.fullmatch(r"(\w+)\[(\d+):(\d+)\]", span.text)):
        out.append(Fix(f"Start at {m[1]}", here, f"{rng[1]}[{m[1]}:{rng[3]}]"))
    if (m := _USE_SETTING.search(help_)) and span.text.strip().isdigit():
        out.append(Fix(f"Use `{m[1]} = {m[2]}`", here, m[2]))
    if (m := _WRITE.search(help_)) and span.text.startswith("zero"):
        out.append(Fix(f"Write `{m[1]}`", here, m[1]))
    if m := _ADD_AFTER.search(help_):
        if span.text == m[2]:
            end = span_loc(span).end
            out.append(Fix(f"Add `{m[1]}` to this stage", Loc(here.file, end, end), f", {m[1]}"))
    # rule fixes: the primary span is the rule of the statement the help is about
    if _RULE_TEXT.fullmatch(span.text):
        if m := _MAKE_RULE.search(help_):
            out.append(Fix(f"Make it `{m[1]}`", here, m[1]))
        if "`replicate`" in help_ and span.text != "replicate" and d.code.startswith("E04") and d.code != "E0406":
            out.append(Fix("Make it `replicate`", here, "replicate"))
        if m := _LOSS.search(help_):
            out.append(Fix(f"Use `loss {m[1]}`", here, m[1]))
    if d.code == "E0406" and (m := _RULE_CHOICES.match(help_)):
        out.extend(Fix(f"Use `{r}`", here, r) for r in re.findall(r"`(\w+)`", m[1]))
    if (m := _WHOLE.search(help_)) and re.fullmatch(r"[0-9.eE+-]+", span.text):
        out.append(Fix(f"Use {m[1]}", here, m[1]))
    if m := _ADD_SHARD.search(help_):
        out.extend(_add_shard(a, d, m[1]))
    if d.code.startswith("E03") and (m := _DIVISORS.search(help_)):
        out.extend(_resize(d, m[1]))
    if d.code == "E0101" and d.note and (m := _MISSING_BRACE.search(d.note)):
        line = int(m[2]) - 1
        out.append(Fix("Insert the missing `}`", Loc(here.file, (line, 0), (line, 0)), "}\n\n"))
    return out


def _resize(d: Diagnostic, listing: str) -> list[Fix]:
    """A divisibility error whose second label is the axis (or setting) declaration: offer each size."""
    values = [int(x) for x in re.findall(r"\d+", listing)]
    out: list[Fix] = []
    for lab in d.secondary:
        m = re.fullmatch(r"(\s*\w+\s*=\s*)(\d+)\s*", lab.span.text)
        if m is None:
            continue
        start = lab.span.start + len(m[1])
        num = lab.span.source.span(start, start + len(m[2]))
        loc = span_loc(num)
        name = lab.span.text.split("=")[0].strip()
        for v in values:
            if str(v) != m[2]:
                out.append(Fix(f"Set `{name} = {v}`", loc, str(v)))
        return out
    # the value itself is the primary span (batch = 24)
    if d.span is not None and d.span.text.strip().isdigit():
        loc = span_loc(d.span)
        out = [Fix(f"Use {v}", loc, str(v)) for v in values if str(v) != d.span.text.strip()]
    return out


def _add_shard(a: Analysis, d: Diagnostic, stmt: str) -> list[Fix]:
    """Insert a missing rule after the plan's last `shard` (or at the top of its body)."""
    from meshllm_dsl import ast

    for it in a.decls.items:
        if not isinstance(it, ast.PlanDecl) or it.span is None or d.span is None:
            continue
        if not (it.span.file == d.span.file and it.span.start <= d.span.start <= it.span.end):
            continue
        shards = [s for s in it.body if isinstance(s, ast.ShardStmt) and s.span is not None]
        anchor = shards[-1].span if shards else None
        if anchor is None:
            return []
        end = span_loc(anchor).end
        line_text = anchor.source.line_text(anchor.line)
        indent = line_text[: len(line_text) - len(line_text.lstrip())]
        return [Fix(f"Add `{stmt}`", Loc(span_loc(anchor).file, end, end), f"\n{indent}{stmt}")]
    return []
