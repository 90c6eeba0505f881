"""Driving a child process from a test: its stderr, collected while the test waits on it."""

from __future__ import annotations

import subprocess
import threading
import time


class StderrReader:
    """Reads ``proc.stderr`` (a pipe) on a thread, so a test can wait for a line while the child runs
    and still see everything it printed when it is gone."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.data = bytearray()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        while chunk := self.proc.stderr.read1(4096):  # type: ignore[attr-defined]
            self.data.extend(chunk)

    def wait_for(self, marker: bytes, timeout: float = 120.0) -> None:
        """Until ``marker`` was printed; fails if the child exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while marker not in self.data:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.data.decode()
            time.sleep(0.1)

    def text(self) -> str:
        """Everything the child printed (after it has exited, all of it)."""
        self._thread.join(timeout=10)
        return self.data.decode()
