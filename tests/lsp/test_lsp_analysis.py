"""In-process sweeps of the language server's analysis: no position and no prefix of a spec may make a
feature raise (the server would answer with an error instead of a result). The protocol itself is
tested over stdio in test_lsp_server.py."""

from __future__ import annotations

from pathlib import Path

from meshllm_dsl.lsp import completion
from meshllm_dsl.lsp.analysis import Analysis

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "llama2_70b.mesh"


def test_every_position_of_an_example_answers() -> None:
    text = LLAMA.read_text()
    a = Analysis(str(LLAMA), text)
    hovered = 0
    for off in range(len(text) + 1):
        hovered += a.hover(off) is not None
        a.definition(off)
        a.references(off)
        completion.complete(a, off)
    assert hovered > len(text) // 4  # most of a spec is names with something to say


def test_every_prefix_of_an_example_is_analysed_without_raising() -> None:
    """What the server sees while a file is typed from the top: each prefix parses or fails with
    exactly one syntax diagnostic, and completion, outline and quick fixes still answer."""
    text = LLAMA.read_text()
    for cut in range(0, len(text), 7):
        a = Analysis(str(LLAMA), text[:cut])
        syntax = [d for d in a.diagnostics if d.code in ("E0101", "E0102")]
        assert len(syntax) <= 1
        a.symbols()
        completion.complete(a, cut)
        for d in a.diagnostics:
            a.fixes(d)
