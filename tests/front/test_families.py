"""Family bodies are checked on their own (issue 26, item 3): a family no model uses still reports
unknown primitives, arguments, choices and names; parameters stand for the values a model will give."""

from __future__ import annotations

from helpers import EXAMPLES

from meshllm_dsl.checker import check_text
from meshllm_dsl.front import ast
from meshllm_dsl.front.load import load
from meshllm_dsl.front.resolve import Resolver, check_family

BODY = """\
family f(vocab, hidden, layers, heads, ffn, act = swiglu, use_bias = false) {{
    embed = embedding(vocab, hidden)
    blocks = repeat(layers) {{
        attn_norm = rmsnorm(hidden)
        attn = attention(hidden, heads, bias = use_bias)
        mlp_norm = rmsnorm(hidden)
        mlp = {mlp}
    }}
    norm = rmsnorm(hidden)
    lm_head = linear(hidden, vocab, tie = embed)
}}
"""
MODEL = "model m = f { vocab = 256, hidden = 64, layers = 2, heads = 4, ffn = 128 }\n"


def codes(text: str) -> list[str]:
    return [d.code for d in check_text(text, "f.mesh").diagnostics]


def test_the_shipped_families_check_clean_on_their_own() -> None:
    # No false alarms: the families every example builds on pass the check a family gets alone.
    families = [f for f in load(EXAMPLES / "tiny_llama.mesh").prelude if isinstance(f, ast.FamilyDecl)]
    assert {f.name.value for f in families} >= {"llama", "gpt2"}
    diags: list = []
    for f in families:
        check_family(f, Resolver(diags))
    assert diags == []


def test_parameters_stand_for_the_model_values() -> None:
    assert codes(BODY.format(mlp="mlp(hidden, ffn, act = act)")) == []


def test_an_unused_family_reports_every_mistake_with_its_place() -> None:
    text = BODY.format(mlp="mamba(hidden, ffn)").replace("bias = use_bias", "sliding = 4096, bias = maybe") \
        .replace("norm = rmsnorm(hidden)\n    lm_head", "norm = rmsnorm(hiddn)\n    lm_head").replace("tie = embed", "tie = blocks")
    ds = check_text(text, "f.mesh").diagnostics
    found = sorted((d.code, d.span.text if d.span else None) for d in ds)
    assert found == sorted([("E0203", "sliding"), ("E0304", "maybe"), ("E0202", "mamba"), ("E0202", "hiddn"),
                            ("E0202", "blocks")])
    assert next(d for d in ds if d.span and d.span.text == "hiddn").help.startswith("did you mean `hidden`?")


def test_a_choice_and_a_missing_argument() -> None:
    assert codes(BODY.format(mlp="mlp(hidden, ffn, act = gelux)")) == ["E0203"]
    assert codes(BODY.format(mlp="mlp(hidden)")) == ["E0205"]


def test_a_used_family_is_reported_once_through_its_model() -> None:
    text = BODY.format(mlp="mamba(hidden, ffn)") + MODEL
    assert codes(text) == ["E0202"]
