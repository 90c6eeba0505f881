"""Where the planner's warnings point inside a plan's source: a setting's word, the plan's header."""

from __future__ import annotations

import re

from meshllm_dsl.front.source import Span


def find_word(span: Span | None, word: str) -> Span | None:
    """The first `word` (as a whole word, outside comments) inside `span`, for pointing at a setting."""
    if span is None:
        return None
    text = span.text
    pos = 0
    for line in text.splitlines(keepends=True):
        code = line.split("#", 1)[0]
        m = re.search(rf"\b{re.escape(word)}\b", code)
        if m:
            return span.source.span(span.start + pos + m.start(), span.start + pos + m.end())
        pos += len(line)
    return None


def header_span(span: Span | None) -> Span | None:
    """`plan NAME on MESH for MODEL` without its body: diagnostics point at a line, not a block."""
    if span is None:
        return None
    brace = span.text.find("{")
    head = span.text[:brace] if brace > 0 else span.text.splitlines()[0]
    return span.source.span(span.start, span.start + len(head.rstrip()))
