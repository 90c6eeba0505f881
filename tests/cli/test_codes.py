"""Diagnostic codes are constants: a typo fails when its module is imported, and the constants and
the explanation table (`meshc explain-error`) are the same set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshllm_dsl import codes

ROOT = Path(__file__).resolve().parents[2]


def test_every_constant_is_explained_and_every_explanation_has_a_constant() -> None:
    constants = {n for n in vars(codes) if re.fullmatch(r"[EW]\d{4}", n)}
    assert constants == set(codes.CODES)
    assert all(getattr(codes, n) == n for n in constants)


def test_the_registry_check_refuses_a_code_out_of_step() -> None:
    names = [n for n in vars(codes) if re.fullmatch(r"[EW]\d{4}", n)]
    with pytest.raises(ImportError, match=r"without an explanation \['E0399'\]"):
        codes.check_registry([*names, "E0399"], codes.CODES)
    with pytest.raises(ImportError, match=r"explanations without a constant \['E0301'\]"):
        codes.check_registry([n for n in names if n != "E0301"], codes.CODES)


def test_a_mistyped_code_fails_at_import() -> None:
    with pytest.raises(ImportError):
        exec("from meshllm_dsl.codes import E0399", {})


def test_a_diagnostic_needs_a_registered_code() -> None:
    from meshllm_dsl.diagnostics import Diagnostic

    assert Diagnostic(codes.E0301, "ok", None).code == "E0301"
    with pytest.raises(ValueError, match="E0399"):
        Diagnostic("E0399", "a code nobody explains", None)


def test_no_emission_site_spells_a_code_as_a_string() -> None:
    """Codes reach Diagnostic through the constants only (the LSP's own E0000 is not a spec code)."""
    literal = re.compile(r'(?<![\w.])"[EW]\d{4}"')
    found = []
    for path in sorted((ROOT / "meshllm_dsl").rglob("*.py")):
        if path.name == "codes.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in literal.finditer(line):
                if m[0] != '"E0000"':
                    found.append(f"{path.relative_to(ROOT)}:{n}: {m[0]}")
    assert not found, found
