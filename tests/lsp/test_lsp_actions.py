"""Every quick fix the server offers on the shipped error files, applied, must leave a file that
still parses and no longer has the diagnostic it fixes (same code on the same line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm_dsl.lsp.analysis import Analysis, LineIndex

ROOT = Path(__file__).resolve().parents[2]
# An editor's buffer is text it already decoded: E0104 (a file that is not UTF-8) is about bytes on
# disk, which `meshc check` reports and an editor shows as its own decoding problem.
ERRORS = sorted(p for p in (ROOT / "examples" / "errors").glob("*.mesh") if not p.name.startswith("E0104"))


def _apply(text: str, fix) -> str:  # type: ignore[no-untyped-def]
    index = LineIndex(text)
    for loc, new_text in sorted(fix.edits, key=lambda e: index.offset(e[0].start), reverse=True):
        text = text[: index.offset(loc.start)] + new_text + text[index.offset(loc.end):]
    return text


@pytest.mark.parametrize("path", ERRORS, ids=lambda p: p.name)
def test_each_quick_fix_removes_its_diagnostic(path: Path) -> None:
    text = path.read_text()
    a = Analysis(str(path), text)
    for d in a.diagnostics:
        assert d.span is not None
        for fix in a.fixes(d):
            assert all(loc.file == str(path) for loc, _ in fix.edits)
            fixed = Analysis(str(path), _apply(text, fix))
            assert fixed.syntax_error is None, (fix.title, fixed.syntax_error)
            still = [x for x in fixed.diagnostics if x.code == d.code and x.span is not None and x.span.line == d.span.line
                     and x.message == d.message]
            assert not still, (fix.title, still)


def test_the_shipped_error_files_offer_fixes() -> None:
    """A floor, so a reworded help that silently loses its quick fix is noticed."""
    with_fixes = set()
    for path in ERRORS:
        a = Analysis(str(path), path.read_text())
        if any(a.fixes(d) for d in a.diagnostics):
            with_fixes.add(path.name.split("_")[0])
    assert {"E0101", "E0202", "E0203", "E0204", "E0301", "E0304", "E0305", "E0402", "E0404", "E0405", "E0406",
            "E0407", "E0501", "E0601", "E0602", "E0606"} <= with_fixes


def test_a_reworded_help_keeps_its_quick_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quick fixes come from the diagnostics' suggestions, never from their help text: with every
    help line reworded, every shipped error file offers exactly the same fixes."""
    from meshllm_dsl.diagnostics import Diagnostic

    def offered() -> dict[str, list[tuple[str, object]]]:
        out = {}
        for path in ERRORS:
            a = Analysis(str(path), path.read_text())
            out[path.name] = [(d.code, f) for d in a.diagnostics for f in a.fixes(d)]
        return out

    before = offered()
    assert sum(map(len, before.values())) >= 40
    init = Diagnostic.__init__

    def reworded(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kw)
        if self.help is not None:
            object.__setattr__(self, "help", "something else entirely")

    monkeypatch.setattr(Diagnostic, "__init__", reworded)
    after = offered()
    helps = [d.help for path in ERRORS[:5] for d in Analysis(str(path), path.read_text()).diagnostics]
    assert helps and set(helps) <= {"something else entirely", None}
    assert after == before
