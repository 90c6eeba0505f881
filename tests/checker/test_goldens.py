"""Golden diagnostics: every examples/errors/*.mesh renders exactly its sibling .expected file.

The .expected text is what a user sees from `meshc check FILE` run in the repository root (stderr,
where errors go, followed by stdout, where warnings and the "ok" line go). Regenerate after an
intended change with `pytest tests/checker --update-goldens` and review the diff.
"""

from __future__ import annotations

import re

import pytest
from helpers import ERRORS, EXAMPLES, ROOT, meshc

from meshllm_dsl.checker import check_file
from meshllm_dsl.codes import CODES

ERROR_FILES = sorted(ERRORS.glob("*.mesh"))
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.mesh"))

# The codes `meshc check` can produce: syntax and names (E01, E02), values (E03), placement (E04),
# coverage (E05), pipeline (E06) and the checker's pitfall warnings (W07). W08xx are the planner's
# (`meshc plan`, tested in tests/planner), not the checker's.
CHECK_CODES = sorted(c for c in CODES if c[:3] in ("E01", "E02", "E03", "E04", "E05", "E06", "W07"))

# Checker codes no spec can produce. Empty: every one is reachable from some .mesh text, so every
# one must have a golden. (Add a code here only with the reason it is unreachable.)
UNREACHABLE: dict[str, str] = {}


def _rel(path) -> str:  # type: ignore[no-untyped-def]
    return str(path.relative_to(ROOT))


def test_there_are_error_examples() -> None:
    # Guards the parametrised tests below against silently running over an empty glob.
    assert len(CHECK_CODES) >= 35
    assert len(ERROR_FILES) >= len(CHECK_CODES)


@pytest.mark.parametrize("path", ERROR_FILES, ids=lambda p: p.stem)
def test_golden(path, request: pytest.FixtureRequest) -> None:  # type: ignore[no-untyped-def]
    code, out, err = meshc("check", _rel(path))
    rendered = err + out
    expected_path = path.with_suffix(".expected")
    if request.config.getoption("--update-goldens"):
        expected_path.write_text(rendered)
    assert expected_path.exists(), f"missing golden {expected_path.name}: run pytest --update-goldens"
    assert rendered == expected_path.read_text()
    # Exit status: 1 for a file with errors, 0 for a warning-only file; never 2 (usage/internal).
    is_warning_file = path.name.startswith("W")
    assert code == (0 if is_warning_file else 1), rendered
    assert "Traceback" not in rendered


@pytest.mark.parametrize("path", ERROR_FILES, ids=lambda p: p.stem)
def test_error_file_shows_its_code_first_class(path) -> None:  # type: ignore[no-untyped-def]
    """The file named after a code produces that code, with a span in the file and a help line."""
    code = path.name.split("_", 1)[0]
    result = check_file(path)
    hits = [d for d in result.diagnostics if d.code == code]
    assert hits, f"{path.name} does not produce {code}: {[d.code for d in result.diagnostics]}"
    for d in hits:
        assert d.span is not None, f"{code} has no span"
        assert d.help, f"{code} has no help line"
    # Warning files must be otherwise clean (they exist to show one pitfall, not errors).
    if code.startswith("W"):
        assert result.ok, [d.code for d in result.errors]


@pytest.mark.parametrize("path", ERROR_FILES, ids=lambda p: p.stem)
def test_error_file_has_header_comment(path) -> None:  # type: ignore[no-untyped-def]
    first = path.read_bytes().decode("utf-8", errors="replace").splitlines()[0]  # E0104 is not UTF-8
    assert re.match(r"# (Mistake|Warning)( \(.*\))?: ", first), first


def test_every_code_has_a_golden() -> None:
    covered = {p.name.split("_", 1)[0] for p in ERROR_FILES}
    # Also count codes that appear in a golden's rendered output, not only in file names.
    for p in ERROR_FILES:
        exp = p.with_suffix(".expected")
        if exp.exists():
            covered |= set(re.findall(r"^(?:error|warning)\[(\w+)\]", exp.read_text(), re.MULTILINE))
    missing = sorted(set(CHECK_CODES) - covered - set(UNREACHABLE))
    assert not missing, f"codes without a golden in examples/errors: {missing}"
    # Every file is named after a real code.
    unknown = sorted({p.name.split("_", 1)[0] for p in ERROR_FILES} - set(CHECK_CODES))
    assert not unknown, unknown


def test_no_orphan_expected_files() -> None:
    orphans = [p.name for p in ERRORS.glob("*.expected") if not p.with_suffix(".mesh").exists()]
    assert not orphans


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_examples_check_clean(path) -> None:  # type: ignore[no-untyped-def]
    result = check_file(path)
    assert result.ok, "\n".join(f"{d.code} {d.message}" for d in result.errors)
    assert result.plans, f"{path.name} declares no plan that checks"
    code, out, err = meshc("check", _rel(path))
    assert code == 0 and "ok: 1 file checked" in out, err


def test_examples_have_header_comments() -> None:
    for path in EXAMPLE_FILES:
        assert path.read_text().startswith("# "), path.name
