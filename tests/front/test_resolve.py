"""Resolver: family defaults, dim arithmetic, primitives expanded to parameters with exact shapes."""

from __future__ import annotations

import pytest

from meshllm_dsl.checker import check_text
from meshllm_dsl.ir import ModelIR, Repeat, Unit


def model_of(src: str, name: str = "m") -> ModelIR:
    result = check_text(src)
    assert result.ok, [(d.code, d.message) for d in result.errors]
    return result.models[name]


LLAMA = "model m = llama {{ vocab = 32000, hidden = {h}, layers = {l}, heads = {a}, {kv} ffn = {f} }}"


@pytest.mark.parametrize(
    "h, n, a, kv, f, params",
    [
        (4096, 32, 32, "", 11008, 6_738_415_616),  # Llama 2 7B
        (5120, 40, 40, "", 13824, 13_015_864_320),  # Llama 2 13B
        (8192, 80, 64, "kv_heads = 8,", 28672, 68_976_648_192),  # Llama 2 70B (GQA)
    ],
    ids=["7b", "13b", "70b"],
)
def test_llama2_parameter_counts(h: int, n: int, a: int, kv: str, f: int, params: int) -> None:
    m = model_of(LLAMA.format(h=h, l=n, a=a, kv=kv, f=f))
    assert m.numel == params


def test_llama_family_defaults() -> None:
    m = model_of(LLAMA.format(h=4096, l=32, a=32, kv="", f=11008))
    values = dict(m.values)
    assert values["kv_heads"] == 32  # kv_heads = heads
    assert values["head_dim"] == 128  # hidden / heads
    assert values["norm_eps"] == 1e-5
    assert m.dtype == "bf16"
    assert [i.name for i in m.items] == ["embed", "blocks", "norm", "lm_head"]
    blocks = m.item("blocks")
    assert isinstance(blocks, Repeat) and blocks.count == 32
    attn = next(u for u in blocks.body if u.name == "attn")
    q, k, _v, o = attn.leaves
    assert q.params[0].shape == (4096, 4096) and k.params[0].shape == (4096, 4096)
    assert o.params[0].shape == (4096, 4096)
    mlp = next(u for u in blocks.body if u.name == "mlp")
    assert [leaf.name for leaf in mlp.leaves] == ["gate", "up", "down"]
    assert mlp.leaves[2].params[0].shape == (4096, 11008)


def test_gqa_shapes_and_units() -> None:
    m = model_of(LLAMA.format(h=8192, l=2, a=64, kv="kv_heads = 8,", f=28672))
    (blocks,) = m.repeats
    assert blocks is not None
    q, k, _v, o = next(u for u in blocks.body if u.name == "attn").leaves
    assert k.params[0].shape == (1024, 8192)  # 8 kv heads x 128
    assert q.out_units == (("heads", 64),)
    assert k.out_units == (("kv_heads", 8),)
    assert o.in_units == (("heads", 64),)


def test_gpt2_family_defaults_and_tie() -> None:
    m = model_of("model m = gpt2 { hidden = 768, layers = 12, heads = 12 }")
    values = dict(m.values)
    assert values["vocab"] == 50257 and values["ffn"] == 3072 and values["positions"] == 1024
    assert m.dtype == "fp32"
    head = m.item("lm_head")
    assert isinstance(head, Unit) and head.leaves[0].tie == "embed" and head.numel == 0  # tied: no own weight
    assert m.numel == 124_439_808  # GPT-2 small as Hugging Face counts it (tied head counted once)
    qkv = next(u for u in m.repeats[0].body if u.name == "attn").leaves[0]  # type: ignore[union-attr]
    assert qkv.name == "qkv" and qkv.params[0].shape == (2304, 768) and qkv.params[0].segments == (768, 768, 768)


def test_dim_arithmetic() -> None:
    m = model_of(
        "model m { a = 6, b = a * 4 - 2, c = (a + 2) * 3, d = b / 11, e = -a + 10, "
        "tok = embedding(d, c)  x = linear(c, d) }"
    )
    values = dict(m.values)
    assert (values["b"], values["c"], values["d"], values["e"]) == (22, 24, 2, 4)
    assert m.numel == 2 * 24 + 24 * 2


@pytest.mark.parametrize(
    "src, code, span_text",
    [
        ("model m { a = 10, b = a / 3, x = linear(a, a) }", "E0302", "a / 3"),
        ("model m { a = 10, b = a / 0, x = linear(a, a) }", "E0302", "a / 0"),
        ("model m { a = 10, x = linear(a, c) }", "E0202", "c"),
        ("model m { a = 0, x = linear(a, a) }", "E0303", "0"),
        ("model m { a = 2.5, x = linear(a, a) }", "E0304", "2.5"),
        ("model m { a = 4, x = linear(a, a, bias = 1) }", "E0304", "1"),
        ("model m { a = 4, x = mlp(a, a, act = tanh) }", "E0203", "tanh"),
        ("model m { a = 4, x = linear(a, a, colour = 1) }", "E0203", "colour"),
        ("model m { a = 4, x = linear(a) }", "E0205", "linear(a)"),
        ("model m { a = 4, x = dense(a, a) }", "E0202", "dense"),
        ("model m { a = 4\n x = linear(a, a)\n x = linear(a, a) }", "E0201", "x"),
        ("model m { a = 8, x = attention(a, 4, 3) }", "E0302", "attention(a, 4, 3)"),
        ("model m = llama { vocab = 8, hidden = 8, layers = 1, heads = 2, ffn = 8, colour = 3 }", "E0203", "colour"),
        ("model m = llamma { vocab = 8 }", "E0202", "llamma"),
        ("model m { a = 4\n e = embedding(a, a)\n x = linear(a, 2, tie = e) }", "E0304", "linear(a, 2, tie = e)"),
    ],
)
def test_model_errors_point_at_the_mistake(src: str, code: str, span_text: str) -> None:
    result = check_text(src)
    codes = [d.code for d in result.errors]
    assert codes == [code], [(d.code, d.message) for d in result.errors]  # exactly one, no cascade
    d = result.errors[0]
    assert d.span is not None and d.span.text == span_text
    assert "m" not in result.models


def test_inexact_head_dim_from_family_default_reports_once() -> None:
    # llama's head_dim = hidden / heads: 4000 / 48 is inexact; the error names the family default
    # and nothing downstream cascades from the missing head_dim.
    result = check_text("model m = llama { vocab = 8, hidden = 4000, layers = 1, heads = 48, ffn = 8 }")
    assert [d.code for d in result.errors] == ["E0302"]
    assert result.errors[0].span is not None and result.errors[0].span.text == "hidden / heads"


def test_missing_family_parameter_reports_once() -> None:
    result = check_text("model m = llama { vocab = 8, hidden = 8, layers = 1, heads = 2 }")
    assert [d.code for d in result.errors] == ["E0205"]
    assert "ffn" in result.errors[0].message


def test_bad_value_through_a_family_points_at_the_users_setting() -> None:
    src = "model m = llama { vocab = 8, hidden = 8, layers = 0, heads = 2, ffn = 8 }"
    (d,) = check_text(src).errors
    assert d.code == "E0303" and d.span is not None and d.span.text == "0" and d.span.file == "<string>"
    assert d.secondary and d.secondary[0].span.file == "<stdlib>/families.mesh"


def test_user_family_overrides_and_dtype() -> None:
    m = model_of(
        "family tiny(d, v = 16, dtype = bf16) { e = embedding(v, d) n = rmsnorm(d) h = linear(d, v) }\n"
        "model m = tiny { d = 8, dtype = fp16 }"
    )
    assert m.numel == 16 * 8 + 8 + 8 * 16 and m.dtype == "fp16"


@pytest.mark.parametrize(
    "mesh, code",
    [
        ("mesh m { axes a = 2, b = 4 devices = 8 hosts = 2 }", None),
        ("mesh m { axes a = 2, b = 4 devices = 6 }", "E0306"),
        ("mesh m { axes a = 2, b = 3 hosts = 4 }", "E0306"),
        ("mesh m { axes a = -1 }", "E0303"),
        ("mesh m { axes a = 2, a = 2 }", "E0201"),
        ("mesh m { axes a = 2 colour = 1 }", "E0203"),
        ("mesh m { axes a = 2 device = tpu9 }", "E0202"),
        ("mesh m { axes forward = 2 }", "E0204"),
        ("mesh m { axes __class__ = 2 }", "E0204"),
        ("mesh m { hosts = 1 }", "E0303"),
    ],
)
def test_mesh_checks(mesh: str, code: str | None) -> None:
    result = check_text(mesh)
    assert [d.code for d in result.errors] == ([code] if code else [])
    if code is None:
        m = result.meshes["m"]
        assert (m.devices, m.hosts, m.devices_per_host) == (8, 2, 4)


def test_a_bool_argument_given_a_name_says_what_to_write() -> None:
    text = ("model m {\n    embed = embedding(64, 32)\n    blocks = repeat(1) {\n        n = rmsnorm(32)\n"
            "        mlp = moe(32, 16, 4, 2, router_bias = maybe)\n    }\n    norm = rmsnorm(32)\n"
            "    head = linear(32, 64)\n}\n")
    (d,) = check_text(text, "m.mesh").errors
    assert (d.code, d.message) == ("E0304", "`router_bias` must be true or false")
    assert d.help == "write `router_bias = true` or `router_bias = false`"
