"""Helpers shared by the front-end tests: the repository root and running `meshc` in-process."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

from meshllm_dsl.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ERRORS = EXAMPLES / "errors"


@contextlib.contextmanager
def in_root() -> Iterator[None]:
    """Run with the repository root as cwd, so rendered paths are relative and stable."""
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(old)


def meshc(*argv: str) -> tuple[int, str, str]:
    """`meshc ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with in_root(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()
