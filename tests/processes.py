"""Driving a child process from a test: its stderr, collected while the test waits on it; a
``python -m`` command run in a fork of the test process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

from meshllm_dsl.cli.job import run_module_and_exit


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


_FORKING = threading.Lock()


def run_module(
    module: str, *args: str, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)``, run
    in a fork of this process instead of a fresh interpreter.

    The test process has imported torch and meshllm already; a fresh ``python -m meshllm_dsl run``
    or ``python -m torch.distributed.run`` spends 2.5-3 CPU-s importing them again before it starts
    a rank (the ranks torchrun starts are fresh interpreters either way).  `meshc run` forks its
    torchrun for the same reason (meshllm_dsl/cli/job.py).  The child runs the module as
    ``python -m`` would (``runpy``, ``__main__``, ``sys.argv``) in its own session, with fresh
    streams on fds 0-2 and exactly ``env`` (default: this process's environment)."""
    env = dict(os.environ if env is None else env)
    with _FORKING:  # a child forked meanwhile on another thread would hold these write ends open
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid != 0:
            os.close(out_w)
            os.close(err_w)
    if pid == 0:
        try:
            os.setsid()
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            # pytest replaced sys.std*: a fresh interpreter would have plain streams on the fds.
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
            if cwd is not None:
                os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = [module, *args]
            # runpy warns (on stderr) when the module was imported already, as a package's part.
            for name in (module, f"{module}.__main__"):
                sys.modules.pop(name, None)
        except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the exit code
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        run_module_and_exit(module)
    streams = {out_r: bytearray(), err_r: bytearray()}
    readers = [threading.Thread(target=_drain, args=(fd, buf), daemon=True) for fd, buf in streams.items()]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    status = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            for t in readers:
                t.join(timeout=10)
            raise subprocess.TimeoutExpired([module, *args], timeout, bytes(streams[out_r]), bytes(streams[err_r]))
        else:
            time.sleep(0.05)
    for t in readers:
        t.join(timeout=30)
    out, err = (bytes(streams[fd]).decode(errors="backslashreplace") for fd in (out_r, err_r))
    return subprocess.CompletedProcess([sys.executable, "-m", module, *args], status, out, err)


def _drain(fd: int, buf: bytearray) -> None:
    try:
        while chunk := os.read(fd, 65536):
            buf.extend(chunk)
    finally:
        os.close(fd)
