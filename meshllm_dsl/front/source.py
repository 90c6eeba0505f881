"""Source files and spans: where every AST node and diagnostic points."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import attrs

# A spec is a few kilobytes; the largest real one (a rule per block of a 10,000-block model) is about
# 1 MB. The cap keeps a mistaken path (a dataset, a device file) from being read into memory.
MAX_SPEC_BYTES = 4 * 1024 * 1024


def normalize_text(text: str) -> str:
    """One notion of a line: \\r\\n, \\r and \\n alike; a leading byte-order mark is not text.

    Every SourceFile goes through this, so the parser, the diagnostics' line numbers, the formatter
    and the hash in generated headers all see the same text whatever editor wrote the file.
    """
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


class UnreadableSpec(Exception):
    """A file that cannot be a spec: missing, not a regular file, too large, binary or not UTF-8.

    ``source`` and ``offset`` locate the first undecodable byte when the file is text otherwise, so
    the diagnostic can point at it; a binary file is never echoed.
    """

    def __init__(self, message: str, help: str, source: SourceFile | None = None, offset: int = 0) -> None:
        super().__init__(message)
        self.message, self.help, self.source, self.offset = message, help, source, offset


@attrs.frozen
class SourceFile:
    """The text of one .mesh file, with a line index for offset -> (line, col)."""

    path: str
    text: str = attrs.field(converter=normalize_text)
    _line_starts: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        starts = [0, *(m.end() for m in re.finditer("\n", self.text))]
        object.__setattr__(self, "_line_starts", tuple(starts))

    @classmethod
    def read(cls, path: str | Path) -> SourceFile:
        """Read a spec file: a regular file under MAX_SPEC_BYTES of UTF-8 text, else UnreadableSpec."""
        name = str(path)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer. fstat on the open file: what is
            # read is what was checked, with no swap in between.
            with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
                info = os.fstat(f.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise UnreadableSpec(f"`{name}` is not a regular file", "a spec is a .mesh text file")
                if info.st_size > MAX_SPEC_BYTES:
                    raise UnreadableSpec(
                        f"`{name}` is {info.st_size:,} bytes; specs are limited to {MAX_SPEC_BYTES:,}",
                        "split the spec with `include`, or use wildcard rules (`blocks.*`) instead of one rule per block",
                    )
                data = f.read(MAX_SPEC_BYTES + 1)
        except OSError as err:
            raise UnreadableSpec(f"cannot read `{name}`: {err.strerror or err}", "check the path") from None
        if b"\0" in data:
            raise UnreadableSpec(f"`{name}` is a binary file, not a spec", "a spec is a .mesh text file (UTF-8)")
        try:
            return cls(name, data.decode("utf-8"))
        except UnicodeDecodeError as err:
            good = data[: err.start].decode("utf-8")
            shown = cls(name, data.decode("utf-8", errors="replace"))
            raise UnreadableSpec(
                f"`{name}` is not valid UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start})",
                "save the file as UTF-8; specs are UTF-8 text",
                shown,
                len(normalize_text(good)),
            ) from None

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
