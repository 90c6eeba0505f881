"""`recompute = blocks | ops every N` in the front end: parsed alike by both parsers, formatted back
as written, and refused where it means nothing (E0203 / E0303 / E0409; the error files in
examples/errors carry the goldens)."""

from __future__ import annotations

import pytest
from test_properties import assert_same_ast, assert_same_tokens

from meshllm_dsl.checker import check_text
from meshllm_dsl.front.fmt import format_text

SPEC = """mesh m {{
    axes data = 1
}}

model l = llama {{ vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64 }}

plan p on m for l {{
    batch = 4
    {setting}
    seq = 16
}}
"""


@pytest.mark.parametrize("setting", ["recompute = blocks every 2", "recompute = ops every (1 + 1)", "recompute = ops"])
def test_both_parsers_agree_and_fmt_keeps_every(setting: str) -> None:
    text = SPEC.format(setting=setting)
    assert_same_tokens(text)
    fast, _ = assert_same_ast(text)
    assert fast[0] != "handed over"
    formatted = format_text(text)
    assert f"    {setting.replace('(1 + 1)', '1 + 1')}\n" in formatted, formatted
    assert format_text(formatted) == formatted
    result = check_text(formatted, "p.mesh")
    assert result.ok, [d.message for d in result.errors]
    (plan,) = result.plans.values()
    assert (plan.recompute, plan.recompute_every) == (setting.split()[2], 2 if "every" in setting else 1)


@pytest.mark.parametrize(("setting", "code"), [
    ("recompute = blocks every 0", "E0303"),
    ("recompute = blocks every 5", "E0409"),
    ("recompute = attention every 2", "E0203"),
    ("recompute = blocks every 1.5", "E0304"),
    ("microbatches = 2 every 2", "E0203"),
])
def test_every_where_it_means_nothing_is_a_located_error(setting: str, code: str) -> None:
    text = SPEC.format(setting=setting)
    result = check_text(text, "p.mesh")
    assert [d.code for d in result.errors] == [code]
    (err,) = result.errors
    assert err.span is not None and text[err.span.start:err.span.end] in setting.split("every")[1]


def test_the_tiny_twin_keeps_enough_blocks_for_every_n() -> None:
    # The twin has 2 blocks per stage; `every 4` would then recompute none of them (E0409 in the twin).
    from meshllm_dsl.verify.twin import twin_values

    text = SPEC.format(setting="recompute = ops every 4").replace("layers = 4", "layers = 32")
    (plan,) = check_text(text, "p.mesh").plans.values()
    assert twin_values(plan)["layers"] == 4
    (plain,) = check_text(text.replace(" every 4", ""), "p.mesh").plans.values()
    assert twin_values(plain)["layers"] == 2
