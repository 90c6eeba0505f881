"""The documentation site (issue 42): docs/reference/ is generated from the code and held equal to it
here (`pytest tests/docs --update-goldens` rewrites it), a changed registry is caught, and the whole
site builds with `mkdocs build --strict` (broken links, anchors or pages missing from the nav fail)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from meshllm_dsl.views import reference

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@pytest.mark.parametrize("page", sorted(reference.PAGES))
def test_reference_page_is_the_codes(page: str, request: pytest.FixtureRequest) -> None:
    text = reference.PAGES[page]()
    path = DOCS / page
    if request.config.getoption("--update-goldens"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing {path}: run pytest tests/docs --update-goldens"
    assert path.read_text() == text, f"{page} differs from the code: run pytest tests/docs --update-goldens"


def test_a_changed_registry_makes_the_reference_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the test above catches: a new schedule, device profile or diagnostic changes its page."""
    from meshllm_dsl import codes, ir
    from meshllm_dsl.lsp import hover
    from meshllm_dsl.parallel import devices

    before = {page: write() for page, write in reference.PAGES.items()}
    monkeypatch.setattr(ir, "SCHEDULES", (*ir.SCHEDULES, "made_up"))
    monkeypatch.setitem(ir.SCHEDULE_VIRTUAL, "made_up", "any")
    monkeypatch.setitem(hover.SCHEDULE_DOCS, "made_up", "a schedule nobody wrote")
    monkeypatch.setitem(devices.PROFILES, "made_up", attrs.evolve(devices.PROFILES["h100"], name="made_up"))
    monkeypatch.setitem(codes.CODES, "E9999", ("made up", "A code nobody emits."))
    after = {page: write() for page, write in reference.PAGES.items()}
    changed = {page for page in before if before[page] != after[page]}
    assert {"reference/schedules.md", "reference/devices.md", "reference/diagnostics.md",
            "reference/language.md"} <= changed
    assert "`made_up`" in after["reference/schedules.md"] and "E9999: made up" in after["reference/diagnostics.md"]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` over docs/ and mkdocs.yml: every page in the nav, every link and anchor
    resolving (mkdocs-material is in the test extra; skipped only where it is not installed)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    mkdocs = shutil.which("mkdocs") or f"{sys.executable} -m mkdocs"
    proc = subprocess.run([*mkdocs.split(), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "diagnostics" / "index.html").exists()
