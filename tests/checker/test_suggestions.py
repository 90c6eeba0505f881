"""Suggestions are fixes as data: applied to its source, each one gives a spec that no longer has
the diagnostic that carried it, on every shipped error file; `--format json` carries them."""

from __future__ import annotations

import json

import pytest
from helpers import ERRORS, meshc

from meshllm_dsl.checker import check_text
from meshllm_dsl.diagnostics import Applicability, Diagnostic, Edit, Suggestion, replace
from meshllm_dsl.front.source import SourceFile

# E0104 is about bytes on disk that are not UTF-8: no text edit is offered for it.
ERROR_FILES = sorted(p for p in ERRORS.glob("*.mesh") if not p.name.startswith("E0104"))


def _same(a: Diagnostic, b: Diagnostic) -> bool:
    return a.code == b.code and a.message == b.message and a.span is not None and b.span is not None \
        and a.span.line == b.span.line


@pytest.mark.parametrize("path", ERROR_FILES, ids=lambda p: p.name)
def test_each_suggestion_applied_removes_its_diagnostic(path) -> None:  # type: ignore[no-untyped-def]
    result = check_text(path.read_text(), str(path))
    for d in result.diagnostics:
        for s in d.suggestions:
            assert s.edits and s.message
            [source] = {e.span.source for e in s.edits}
            assert source.path == str(path), (s, "a suggestion edits the file its diagnostic is in")
            fixed = check_text(s.apply(source.text), str(path))
            assert not [x for x in fixed.diagnostics if _same(x, d)], (path.name, s.message)


# Mistakes no shipped error file makes, written into valid examples:
# (file, text there, the mistake in its place, the suggestion's title, the text it writes back).
MISTAKES = [
    ("tiny_llama.mesh", "shard lm_head column(tensor)", "shard lm_head replicate(tensor)", "Remove the axes",
     "shard lm_head replicate"),
    ("llama2_70b.mesh", ", norm,", ", norm[0:1],", "Write `norm`", ", norm,"),
]


@pytest.mark.parametrize("name,right,wrong,title,fixed", MISTAKES, ids=[m[3] for m in MISTAKES])
def test_a_machine_applicable_suggestion_makes_the_spec_check(name, right, wrong, title, fixed) -> None:  # type: ignore[no-untyped-def]
    path = ERRORS.parent / name
    text = path.read_text()
    assert right in text
    [d] = check_text(text.replace(right, wrong), str(path)).diagnostics
    [s] = d.suggestions
    assert (s.message, s.applicability) == (title, Applicability.MACHINE_APPLICABLE)
    after = s.apply(d.span.source.text)  # type: ignore[union-attr]
    assert after == text.replace(right, fixed)
    assert check_text(after, str(path)).ok


def test_the_shipped_error_files_carry_suggestions() -> None:
    """A floor: every kind of fix the checker offered when this was written still comes."""
    codes = set()
    for path in ERROR_FILES:
        if any(d.suggestions for d in check_text(path.read_text(), str(path)).diagnostics):
            codes.add(path.name.split("_")[0])
    assert {"E0101", "E0202", "E0203", "E0204", "E0301", "E0304", "E0305", "E0310", "E0312", "E0402", "E0403",
            "E0404", "E0405", "E0406", "E0407", "E0408", "E0501", "E0502", "E0601", "E0602", "E0606",
            "E0607", "E0609"} <= codes


def test_a_suggestion_with_several_edits_applies_them_together() -> None:
    src = SourceFile("x.mesh", "shard a row(t)\nshard b column(t)\n")
    first, second = src.span(8, 14), src.span(23, 32)
    s = Suggestion("Replicate both", (Edit(second, "replicate"), Edit(first, "replicate")))
    assert s.apply(src.text) == "shard a replicate\nshard b replicate\n"
    assert replace(first, "row(t)") == ()  # proposing what is already there is no suggestion


def test_json_carries_suggestions() -> None:
    path = ERRORS / "E0202_unknown_axis.mesh"
    rc, out, _err = meshc("check", "--format", "json", str(path))
    assert rc == 1
    [d] = json.loads(out)
    [s] = d["suggestions"]
    assert s["message"] == "Replace `tensr` with `tensor`"
    assert s["applicability"] == Applicability.MAYBE_INCORRECT.value == "MaybeIncorrect"
    [e] = s["edits"]
    assert e["replacement"] == "tensor"
    assert (e["line"], e["end_line"], e["end_column"] - e["column"]) == (d["span"]["line"],) * 2 + (len("tensr"),)
    assert e["file"] == d["span"]["file"]


def test_text_output_does_not_show_suggestions() -> None:
    """Suggestions are for tools; the rendered diagnostic keeps its help line only (goldens)."""
    path = ERRORS / "E0202_unknown_axis.mesh"
    _rc, out, err = meshc("check", str(path))
    assert "Replace `tensr`" not in out + err and "help: did you mean `tensor`?" in out + err
