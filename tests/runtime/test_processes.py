"""tests/processes.py's ``run_module``: a forked ``python -m`` that behaves like the real one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from processes import run_module

MODULE = """
import os, sys, time
print("out", sys.argv[1:], os.getcwd(), os.environ.get("PROBE"))
print("err", __name__, file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "probe_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "probe_mod"


@pytest.mark.parametrize("how", ["fork", "interpreter"])
def test_run_module_gives_what_a_fresh_interpreter_gives(probe: str, tmp_path: Path, how: str) -> None:
    env = {"PROBE": "p", "PYTHONPATH": str(tmp_path)}
    for args in (["3"], ["raise"]):
        if how == "fork":
            got = run_module(probe, *args, env=env, cwd=tmp_path / "..")
        else:
            got = subprocess.run([sys.executable, "-m", probe, *args], env=env, cwd=tmp_path / "..",
                                 capture_output=True, text=True, check=False)
        assert got.stdout == f"out {args} {tmp_path.parent} p\n"
        assert got.stderr.startswith("err __main__\n")
        if args == ["3"]:
            assert (got.returncode, got.stderr) == (3, "err __main__\n")
        else:
            assert got.returncode == 1
            assert "Traceback (most recent call last)" in got.stderr and got.stderr.endswith("ValueError: boom\n")


def test_run_module_kills_the_child_at_its_timeout(probe: str) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_module(probe, "sleep", timeout=1)
