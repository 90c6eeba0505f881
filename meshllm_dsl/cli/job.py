"""Running a torchrun job for `meshc run`: signals forwarded, output condensed, nothing left behind.

torchrun starts every worker in its own session, so a signal to `meshc` (or to torchrun's process
group) never reaches the workers, and killing torchrun orphans them.  `run_job` therefore starts
torchrun in a new session, forwards SIGINT / SIGTERM to it (torchrun then stops its workers),
tracks the job's processes while it runs, and kills any that outlive torchrun.  Without `--debug`
the launcher's own reports (a Python traceback of torchrun, its "Root Cause" table, elastic log
lines) are dropped: every rank already printed one line saying what happened to it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from meshllm_dsl.runtime.train.startup import ENV as STARTUP_ENV
from meshllm_dsl.runtime.train.startup import StartupLine

__all__ = ["run_job"]

# How long torchrun gets to stop its workers after a forwarded signal before everything is killed:
# beyond torchrun's own 30 s SIGTERM grace, in which a rank finishes its step and checkpoints.
STOP_GRACE_S = 40.0

_LOG_LINE = re.compile(rb"^\[?[WEI]\d{4} \d\d:\d\d:\d\d")  # glog-style lines of torch.distributed.elastic
_ROOT_RANK = re.compile(rb"^\s*rank\s*:\s*(\d+)")
_ROOT_EXIT = re.compile(rb"^\s*exitcode\s*:\s*(-?\d+)")


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def _descendants(pid: int) -> set[int]:
    seen: set[int] = set()
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _is_ours(pid: int, marker: str) -> bool:
    """Still the job's process (not a reused pid): its command line names the job's directory."""
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class _Relay(threading.Thread):
    """Copies the job's stderr to ours, dropping launcher noise unless ``debug``."""

    def __init__(self, stream: int, debug: bool, tty: bool | None = None) -> None:
        super().__init__(daemon=True)
        self.fd, self.debug = stream, debug
        # The ranks' start-up markers become one line redrawn in place, on a terminal only.
        self.startup = StartupLine(sys.stderr.isatty() if tty is None else tty)
        self.saw_error = False
        self.exits: list[tuple[int, int]] = []  # (rank, exit code) from torchrun's failure table
        self._rank: int | None = None
        self._muted = False
        self._open = False  # the last thing written was a partial line (the progress bar)
        self.rdzv_failure: str | None = None  # "timeout" / "connection": torchrun's rendezvous failed

    def _line(self, line: bytes) -> None:
        if self.startup.take(line):
            return
        if line.startswith(b"error: "):
            self.saw_error = True
        if b"RendezvousTimeoutError" in line:
            self.rdzv_failure = "timeout"
        elif b"RendezvousConnectionError" in line and self.rdzv_failure is None:
            self.rdzv_failure = "connection"
        rank, code = _ROOT_RANK.match(line), _ROOT_EXIT.match(line)
        if rank:
            self._rank = int(rank.group(1))
        elif code and self._rank is not None:
            self.exits.append((self._rank, int(code.group(1))))
            self._rank = None
        if not self.debug:
            if line.startswith(b"Traceback (most recent call last)"):
                self._muted = True  # the launcher's own traceback and failure table follow
            if self._muted or _LOG_LINE.match(line):
                return
        if not line and not self._open:
            return  # ranks start their reports on a fresh line; no blank lines in between
        self._write(line + b"\n")

    def _write(self, data: bytes) -> None:
        self.startup.write(data)
        self._open = not data.endswith(b"\n")

    def run(self) -> None:
        self.startup.start()
        self._run()
        self.startup.close()

    def _run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._line(line)
            if pending.startswith(b"\r"):  # the progress bar redraws its line: show it now
                self._write(pending)
                pending = b""
        if pending:
            self._line(pending)


def killed_rank(exits: list[tuple[int, int]]) -> str | None:
    """"rank R was killed (SIGNAME)" from torchrun's failure table (rank, exit code), or None.

    A rank killed from outside comes first: torchrun stops the others with SIGTERM once one has
    gone, and its table may list one of those before the rank that was killed."""
    killed = [(r, c) for r, c in exits if c < 0]
    if not killed:
        return None
    rank, code = sorted(killed, key=lambda rc: rc[1] == -signal.SIGTERM)[0]
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"rank {rank} was killed ({name})"


class _Forked:
    """The part of ``subprocess.Popen`` that `run_job` uses, for a child made by ``os.fork``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


_TORCHRUN = ["-m", "torch.distributed.run"]


def _start(cmd: list[str], env: dict[str, str], stderr: int, close: int) -> subprocess.Popen[bytes] | _Forked:
    """Start ``cmd`` in a new session with ``stderr`` as its stderr.

    When ``cmd`` is torchrun and this process has imported torch already (`meshc run` has, checking
    the inputs), torchrun runs in a fork of this process: a fresh interpreter would spend seconds
    importing torch again before it starts the first rank (2.5 CPU-s on a 2-core machine).  The
    ranks are started by torchrun as before, each a fresh interpreter."""
    if cmd[1:3] != _TORCHRUN or "torch" not in sys.modules:
        return subprocess.Popen(cmd, env=env, stderr=stderr, start_new_session=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _Forked(pid)
    try:
        os.setsid()
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(close)
        # A fresh stream on fd 2, as a new interpreter has: sys.stderr may have been replaced (pytest).
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [cmd[0], *cmd[3:]]
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the exit code
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    run_module_and_exit("torch.distributed.run")


def run_module_and_exit(module: str) -> NoReturn:
    """In a forked child: run ``module`` as ``python -m`` would and end the process with the exit
    code a fresh interpreter would give (a SystemExit's int, 1 with its message printed for a str,
    1 with the traceback for any other exception), never returning into the parent's code."""
    code = 1
    try:
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the exit code
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_job(
    cmd: list[str], env: dict[str, str], marker: str, debug: bool = False,
    rendezvous: tuple[str, int, float] | None = None,
) -> int:
    """Run ``cmd`` (torchrun) to the end; 0 ok, 1 failed, 130 / 143 when interrupted.

    ``marker`` is a string in every job process's command line (the job's temporary directory).
    ``rendezvous`` (endpoint, nodes, timeout) names a multi-node job's rendezvous in its failures.
    """
    read_fd, write_fd = os.pipe()
    env = {**env, STARTUP_ENV: "1"}  # ranks report their start-up phases to the relay
    proc = _start(cmd, env, write_fd, close=read_fd)
    os.close(write_fd)
    relay = _Relay(read_fd, debug)
    relay.start()
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not received:
            print("\nmeshc: interrupted; stopping the job", file=sys.stderr, flush=True)
        received.append(signum)
        if proc.poll() is None:
            # SIGTERM either way: torchrun passes the signal on to the workers, and SIGINT would
            # make each of them print a KeyboardInterrupt.
            proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    seen: set[int] = set()
    try:
        stop_by: float | None = None
        while proc.poll() is None:
            seen |= _descendants(proc.pid)
            if received and stop_by is None:
                stop_by = time.monotonic() + STOP_GRACE_S
            if stop_by is not None and time.monotonic() > stop_by:
                for pid in [proc.pid, *seen]:
                    if pid == proc.pid or _is_ours(pid, marker):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
            time.sleep(0.1)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        # Workers live in their own sessions: any that outlived torchrun are killed here.
        for pid in seen:
            if _is_ours(pid, marker):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        relay.join(timeout=5)
        os.close(read_fd)
    if received:
        return 128 + received[0]
    if proc.returncode == 0:
        return 0
    if not relay.saw_error and rendezvous is not None and relay.rdzv_failure is not None:
        endpoint, nodes, timeout = rendezvous
        if relay.rdzv_failure == "timeout":
            print(f"error: rendezvous at {endpoint} timed out after {timeout:g} s: not all {nodes} nodes "
                  "arrived (is `meshc run` started on every node with the same --rdzv-endpoint and --rdzv-id?)",
                  file=sys.stderr)
        else:
            print(f"error: cannot reach the rendezvous at {endpoint} (is node 0 up, and the address right?)",
                  file=sys.stderr)
    elif not relay.saw_error:
        # A rank killed from outside printed nothing; torchrun's table knows it (its "Root Cause"
        # may name a healthy rank that merely noticed first).
        killed = killed_rank(relay.exits)
        if killed:
            print(f"error: {killed}", file=sys.stderr)
        else:
            print(f"error: the job failed (torchrun exit {proc.returncode}); rerun with --debug for details", file=sys.stderr)
    return 1
