"""`meshc run`'s start-up line: what the ranks are doing between the launch and the first step.

Starting 8 ranks on a small machine takes many seconds (interpreters and torch imported in turn,
the process group joined, the stages built); without a word a user cannot tell a slow start from a
hang.  Ranks started by ``meshc run`` (it sets ``MESHLLM_STARTUP=1`` for them) write one marker line
on stderr at each phase; meshc's relay (``meshllm_dsl/cli/job.py``) folds the markers into a single
line redrawn in place while stderr is a terminal, and drops them when it is not.  Under a plain
torchrun the variable is unset and ranks write nothing.  Free of torch: meshc's parent imports it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["ENV", "PHASES", "StartupLine", "report"]

ENV = "MESHLLM_STARTUP"
_MARK = b"meshllm-startup "
# In order: the interpreter imported torch and the module ("up"), the process group is joined,
# the stage modules are built (weights initialised or loaded, optimizer made).
PHASES = ("up", "joined", "built")
_CLEAR = b"\r\x1b[K"  # back to the start of the line and erase it


def report(phase: str) -> None:
    """On a rank: say that this rank reached ``phase`` (only under ``meshc run``)."""
    if os.environ.get(ENV) != "1":
        return
    local, count = os.environ.get("LOCAL_RANK", "0"), os.environ.get("LOCAL_WORLD_SIZE", "1")
    # One write of one short line: atomic on a pipe, so ranks writing at once never interleave.
    os.write(2, _MARK + f"{local} {count} {phase} {time.time():.3f}\n".encode())


def parse(line: bytes) -> tuple[int, int, str, float] | None:
    """(local rank, ranks on this node, phase, wall time) of a marker line; None for any other."""
    if not line.startswith(_MARK):
        return None
    try:
        rank, count, phase, stamp = line[len(_MARK) :].decode().split()
        if phase not in PHASES:
            return None
        return int(rank), int(count), phase, float(stamp)
    except ValueError:
        return None


class StartupLine:
    """The relay's side: consumes markers, draws ``starting (9 s): 5/8 ranks up (importing torch)``.

    ``tty`` false: markers are swallowed and nothing is drawn (a log file gets no redraws).  Once
    every rank is built, the next output the job writes (the training bar, ``generated [...]``)
    ends the line for good.  ``tick`` seconds: how often a shown line redraws its clock (the ranks'
    imports say nothing for many seconds); 0 for never.
    """

    def __init__(self, tty: bool, clock: Callable[[], float] = time.monotonic, tick: float = 1.0,
                 out: BinaryIO | None = None) -> None:
        self.tty, self.clock, self.tick, self._out = tty, clock, tick, out
        self.t0 = clock()
        self.phase: dict[int, int] = {}  # local rank -> index of its latest phase
        self.world = 0
        self.drawn = False  # the line is on the screen now
        self.finished = False
        self._lock = threading.Lock()  # the relay and the ticker write to one stream
        self._stop = threading.Event()

    def out(self) -> BinaryIO:
        import sys

        return self._out or sys.stderr.buffer

    def write(self, data: bytes) -> None:
        """Write the job's output ``data``, erasing the line first and redrawing it after."""
        with self._lock:
            self._emit(self.clear() + data + self.after(data))

    def show(self, data: bytes) -> None:
        with self._lock:
            self._emit(data)

    def take(self, line: bytes) -> bool:
        """True if ``line`` is a rank's marker: consumed (and the line redrawn), not to be printed."""
        with self._lock:
            status = self.consume(line)
            if status is None:
                return False
            self._emit(status)
            return True

    def _emit(self, data: bytes) -> None:
        if data:
            out = self.out()
            out.write(data)
            out.flush()

    def start(self) -> None:
        """Draw the line and keep its clock running until the job's first real output."""
        self.show(self.begin())
        if self.tty and self.tick > 0:
            threading.Thread(target=self._ticker, daemon=True, name="meshc-startup").start()

    def close(self) -> None:
        self._stop.set()
        self.show(self.clear())

    def _ticker(self) -> None:
        while not self._stop.wait(self.tick):
            with self._lock:
                if self.finished:
                    return
                if self.drawn:
                    self._emit(self._draw())

    def text(self) -> str:
        took = f"starting ({self.clock() - self.t0:.0f} s)"
        n = self.world
        if not n:
            return f"{took}: torchrun is starting the ranks (each imports torch)"
        reached = [sum(p >= i for p in self.phase.values()) for i in range(len(PHASES))]
        if reached[0] < n:
            return f"{took}: {reached[0]}/{n} ranks up (importing torch)"
        if reached[1] < n:
            return f"{took}: {n}/{n} ranks up, {reached[1]}/{n} joined the process group"
        if reached[2] < n:
            return f"{took}: {n}/{n} ranks in the process group, {reached[2]}/{n} built their stages"
        return f"{took}: {n}/{n} ranks ready, first step"

    def _draw(self) -> bytes:
        if not self.tty or self.finished:
            return b""
        self.drawn = True
        return _CLEAR + self.text().encode()

    def begin(self) -> bytes:
        """What to write as the job starts."""
        return self._draw()

    def consume(self, line: bytes) -> bytes | None:
        """None if ``line`` is not a marker (the relay prints it); else what to write instead."""
        got = parse(line)
        if got is None:
            return None
        rank, self.world, phase, _ = got
        self.phase[rank] = max(self.phase.get(rank, 0), PHASES.index(phase))
        return self._draw()

    def clear(self) -> bytes:
        """What to write before other output: the line erased if it is shown."""
        if not self.drawn:
            return b""
        self.drawn = False
        return _CLEAR

    def after(self, data: bytes) -> bytes:
        """What to write after other output ``data``: the line again while ranks are starting."""
        ready = self.world and sum(p == len(PHASES) - 1 for p in self.phase.values()) >= self.world
        if ready:
            self.finished = True
        if not data.endswith(b"\n"):
            return b""  # a partial line (the training bar) keeps its line
        return self._draw()
