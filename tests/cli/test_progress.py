"""Long commands say what they are doing on a terminal and nothing elsewhere (issue 26, item 4):
`meshc suggest` through a real pty and a pipe, `meshc verify` with the terminal decision injected."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys

from helpers import ROOT

from meshllm_dsl.progress import StatusLine
from meshllm_dsl.verify.equivalence import verify

SUGGEST = [sys.executable, "-P", "-m", "meshllm_dsl", "suggest", "examples/tiny_llama.mesh", "--devices", "4",
           "--device", "cpu"]


def _run_on_pty(argv: list[str]) -> tuple[int, str, str]:
    """argv with stderr on a pseudo-terminal: (exit code, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    shown = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal (EIO)
            break
        if not chunk:
            break
        shown += chunk
    out = proc.communicate(timeout=60)[0]
    os.close(master)
    return proc.returncode, out.decode(), shown.decode()


def test_suggest_shows_progress_on_a_terminal_only() -> None:
    code, out, shown = _run_on_pty(SUGGEST)
    assert code == 0 and "#1" in out
    assert "meshc suggest: searching: candidate 1 of" in shown
    assert shown.endswith("\r\x1b[K")  # erased before the result is printed: nothing left on the line
    piped = subprocess.run(SUGGEST, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0 and piped.stdout == out
    assert piped.stderr == ""  # a log file gets no redraws


def test_status_line_redraws_in_place_and_erases_itself() -> None:
    times = iter([0.0, 1.2, 7.9])
    stream = io.StringIO()
    with StatusLine("meshc x", stream, tty=True, clock=lambda: next(times), tick=0) as line:
        line.update("one")
        line.update("two")
    assert stream.getvalue() == "\r\x1b[Kmeshc x: one (1 s)\r\x1b[Kmeshc x: two (8 s)\r\x1b[K"
    quiet = io.StringIO()
    with StatusLine("meshc x", quiet, tty=False) as line:
        line.update("one")
    assert quiet.getvalue() == ""


def test_verify_says_what_it_is_doing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "two.mesh"
    spec.write_text("mesh m {\n    axes tensor = 2\n    device = cpu\n}\n"
                    "model t = llama { vocab = 64, hidden = 16, layers = 1, heads = 2, ffn = 32 }\n"
                    "plan p on m for t {\n    batch = 2\n    seq = 8\n"
                    "    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }\n}\n")
    stream = io.StringIO()
    report, equal = verify(str(spec), None, status=StatusLine("meshc verify", stream, tty=True, tick=0))
    assert equal, report
    assert "no pipeline" in report.splitlines()[0] and "schedule" not in report.splitlines()[0]
    shown = stream.getvalue()
    assert "meshc verify: starting 2 processes" in shown
    assert "meshc verify: comparing the twin sharded on 2 processes" in shown
    assert shown.endswith("\r\x1b[K")
