"""List values (`[1.0, 1.5, ...]`) and the attention setting that takes them, longrope's factors:
parsed with spans, formatted back, checked against head_dim / 2, cut down in the tiny twin, and
printed into generated code as float literals only."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm_dsl.checker import check_text
from meshllm_dsl.diagnostics import SpecError
from meshllm_dsl.front import ast
from meshllm_dsl.front.fmt import format_text
from meshllm_dsl.front.parser import parse

SHORT = "[1.0, 1_0, 2.5e-1, ffn / 64, 1.25, 1.5, 1.75, 2.0]"  # head_dim 16: 8 factors


def _spec(short: str = SHORT, long: str = "[1.0, 2.0, 4.0, 8.0, 9.0, 10.0, 11.0, 12.0]", extra: str = "") -> str:
    return ("mesh m { axes tensor = 2 }\n"
            "model phi = llama {\n"
            "    vocab = 64, hidden = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32\n"
            f"    rope_type = longrope, rope_factor = 4.0, rope_original_positions = 6{extra}\n"
            f"    rope_short_factor = {short}\n"
            f"    rope_long_factor = {long}\n"
            "}\n"
            "plan p on m for phi {\n"
            "    batch = 4, seq = 8\n"
            "    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }\n"
            "}\n")


def test_a_list_parses_with_its_span_items_and_a_trailing_comma() -> None:
    text = "model m = llama {\n    a = [1.0,\n         -2, x * 2,]\n    b = []\n}\n"
    model = parse(text).items[0]
    assert isinstance(model, ast.ModelDecl)
    a, b = (s.value for s in model.settings)
    assert isinstance(a, ast.ListLit) and a.span is not None
    assert a.span.text == "[1.0,\n         -2, x * 2,]"
    assert [x.span.text for x in a.items] == ["1.0", "-2", "x * 2"]  # type: ignore[union-attr]
    assert b == ast.ListLit(())


@pytest.mark.parametrize("src", [
    "model m = llama { a = [[1.0]] }",  # no nested lists
    "model m = llama { a = [1.0] + 1 }",  # no arithmetic on a list
    "model m = llama { a = [1.0 2.0] }",  # items are separated by commas
])
def test_what_is_not_a_list_is_a_syntax_error(src: str) -> None:
    with pytest.raises(SpecError) as err:
        parse(src)
    assert [d.code for d in err.value.diagnostics] == ["E0101"]


def test_a_long_list_formats_in_rows_and_parses_back() -> None:
    items = ", ".join(f"{1 + i / 64!r}" for i in range(48))  # Phi-3 mini: head_dim 96, 48 factors
    text = f"model m = llama {{ rope_short_factor = [{items}] }}\n"
    formatted = format_text(text)
    lines = formatted.splitlines()
    assert lines[1] == "    rope_short_factor = [" and lines[-2] == "    ]"
    assert all(len(line) <= 100 for line in lines) and len(lines) > 5
    assert parse(formatted) == parse(text) and format_text(formatted) == formatted


def test_longrope_is_built_with_the_factors_as_floats() -> None:
    result = check_text(_spec(), "phi.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    attn = next(u for item in result.plans["p"].model.items for u in getattr(item, "body", ()) if u.kind == "attention")
    scaling = dict(dict(attn.attrs)["rope_scaling"])
    assert scaling == {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 6,
                       "short_factor": (1.0, 10.0, 0.25, 1.0, 1.25, 1.5, 1.75, 2.0),
                       "long_factor": (1.0, 2.0, 4.0, 8.0, 9.0, 10.0, 11.0, 12.0)}
    assert all(type(x) is float for x in scaling["short_factor"])


def test_generated_code_carries_the_factors_as_float_literals() -> None:
    from meshllm_dsl.codegen.emit import render_plan

    text = _spec()
    code = render_plan(check_text(text, "phi.mesh").plans["p"], "phi.mesh", text)
    line = next(x for x in code.splitlines() if "rt.apply_rotary" in x)
    assert "('short_factor', (1.0, 10.0, 0.25, 1.0, 1.25, 1.5, 1.75, 2.0))" in line
    assert "ffn" not in line and "1_0" not in line  # values, never the spec's text


def test_the_tiny_twin_cuts_the_factors_to_its_head_dim(tmp_path: Path) -> None:
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.verify.twin import HEAD_DIM, make_twin

    path = tmp_path / "phi.mesh"
    path.write_text(_spec())
    twin_text, twin = make_twin(check_file(path), "p", str(path))
    assert twin.ok, [d.message for d in twin.diagnostics]
    attn = next(u for item in twin.plans["p"].model.items for u in getattr(item, "body", ()) if u.kind == "attention")
    scaling = dict(dict(attn.attrs)["rope_scaling"])
    assert dict(attn.attrs)["head_dim"] == HEAD_DIM
    # evenly spaced picks of the 8, first and last kept
    assert scaling["short_factor"] == (1.0, 0.25, 1.5, 2.0)
    assert scaling["long_factor"] == (1.0, 4.0, 10.0, 12.0)


def test_comments_among_a_lists_items_stay_on_their_lines() -> None:
    text = ("model m = llama {\n    a = [1.0,  # first\n         # before the second\n         2.0,\n"
            "   # last\n    ]  # after\n    b = 1\n}\n")
    formatted = format_text(text)
    assert formatted == ("model m = llama {\n    a = [\n        1.0,  # first\n        # before the second\n"
                         "        2.0,\n        # last\n    ]  # after\n    b = 1\n}\n")
    assert parse(formatted) == parse(text) and format_text(formatted) == formatted
