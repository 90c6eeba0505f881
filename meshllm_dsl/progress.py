"""A status line for long commands (`meshc verify`, `meshc suggest`): what they are doing and for how
long, redrawn in place on stderr while it is a terminal and silent when it is not (a log file or a
pipe gets no redraws, as with `meshc run`'s training bar). A ticker redraws the clock while a phase
runs without reporting (a pool of ranks comparing a twin says nothing for many seconds)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

_CLEAR = "\r\x1b[K"  # back to the start of the line and erase it


class StatusLine:
    """``with StatusLine() as s: s.update("checking 12 of 480 candidates")`` shows
    ``meshc suggest: checking 12 of 480 candidates (3 s)`` until the block ends, then erases it."""

    def __init__(self, what: str, stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, tick: float = 1.0) -> None:
        self.what, self.stream, self.clock, self.tick = what, stream or sys.stderr, clock, tick
        self.tty = _isatty(self.stream) if tty is None else tty
        self.t0 = clock()
        self.text = ""
        self.drawn = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> StatusLine:
        if self.tty and self.tick > 0:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if self.drawn:
                self.stream.write(_CLEAR)
                self.stream.flush()
                self.drawn = False

    def update(self, text: str) -> None:
        self.text = text
        self._draw()

    def _draw(self) -> None:
        if not self.tty or not self.text:
            return
        with self._lock:
            self.stream.write(f"{_CLEAR}{self.what}: {self.text} ({self.clock() - self.t0:.0f} s)")
            self.stream.flush()
            self.drawn = True

    def _tick(self) -> None:
        while not self._stop.wait(self.tick):
            self._draw()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False
