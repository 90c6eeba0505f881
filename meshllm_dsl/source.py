"""Source files and spans: where every AST node and diagnostic points."""

from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class SourceFile:
    """The text of one .mesh file, with a line index for offset -> (line, col)."""

    path: str
    text: str
    _line_starts: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        starts = [0]
        for i, ch in enumerate(self.text):
            if ch == "\n":
                starts.append(i + 1)
        object.__setattr__(self, "_line_starts", tuple(starts))

    @classmethod
    def read(cls, path: str | Path) -> SourceFile:
        # errors="replace": a byte-mutated file must still produce diagnostics, not a traceback.
        data = Path(path).read_bytes()
        return cls(str(path), data.decode("utf-8", errors="replace"))

    def line_text(self, line: int) -> str:
        """The text of 1-based `line`, without its newline."""
        if line < 1 or line > len(self._line_starts):
            return ""
        start = self._line_starts[line - 1]
        end = self.text.find("\n", start)
        return self.text[start:] if end < 0 else self.text[start:end]

    def position(self, offset: int) -> tuple[int, int]:
        """1-based (line, column) of a character offset."""
        import bisect

        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self._line_starts, offset)
        return line, offset - self._line_starts[line - 1] + 1

    def span(self, start: int, end: int) -> Span:
        return Span(self, start, max(end, start))


@attrs.frozen
class Span:
    """A half-open character range [start, end) in a source file."""

    source: SourceFile = attrs.field(repr=False)
    start: int
    end: int

    @property
    def file(self) -> str:
        return self.source.path

    @property
    def line(self) -> int:
        return self.source.position(self.start)[0]

    @property
    def column(self) -> int:
        return self.source.position(self.start)[1]

    @property
    def text(self) -> str:
        return self.source.text[self.start : self.end]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"
