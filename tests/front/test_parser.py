"""Parser: every construct of grammar/mesh.lark becomes the right AST node, with exact spans."""

from __future__ import annotations

import pytest

from meshllm_dsl.diagnostics import SpecError
from meshllm_dsl.front import ast
from meshllm_dsl.front.parser import parse

FULL = """\
include "shared.mesh"  # a trailing comment
device mygpu { memory = 80, tflops = 989.5 }
mesh m {
    axes data = 2, tensor = 2 * 2
    hosts = 1
    device = mygpu
}
family fam(vocab, hidden, ffn = 4 * hidden) {
    embed = embedding(vocab, hidden)
    blocks = repeat(2) {
        attn = attention(hidden, 4, fused_qkv = true)
    }
}
model a = fam { vocab = 256, hidden = 64 }
model b {
    hidden = 64
    x = linear(hidden, hidden / 2 - -1, bias = true,)
}
plan p on m for a {
    batch = 8, seq = 32
    layout { batch -> data, heads -> tensor * data }
    shard blocks.*.attn.{q,k} column(tensor)
    shard blocks.0.attn.o row(tensor, data)
    shard embed replicate
    loss vocab_parallel(tensor)
    stages over data virtual 2 {
        0: embed, blocks[0:1]
        1:
    }
    schedule interleaved_1f1b
    optimizer adamw { zero 1 over data * tensor
        lr = 1e-3 }
}
"""


@pytest.fixture(scope="module")
def module() -> ast.Module:
    return parse(FULL, "full.mesh")


def text(node: object) -> str:
    span = node.span  # type: ignore[attr-defined]
    assert span is not None
    return span.text


def test_items_in_order(module: ast.Module) -> None:
    kinds = [type(i).__name__ for i in module.items]
    assert kinds == ["Include", "DeviceDecl", "MeshDecl", "FamilyDecl", "ModelDecl", "ModelDecl", "PlanDecl"]


def test_include_and_device(module: ast.Module) -> None:
    inc, dev = module.items[0], module.items[1]
    assert isinstance(inc, ast.Include) and inc.path.value == "shared.mesh"
    assert text(inc.path) == '"shared.mesh"'
    assert isinstance(dev, ast.DeviceDecl)
    assert [(s.name.value, s.value) for s in dev.settings] == [("memory", ast.IntLit(80)), ("tflops", ast.FloatLit("989.5"))]


def test_mesh(module: ast.Module) -> None:
    m = module.items[2]
    assert isinstance(m, ast.MeshDecl)
    assert [a.name.value for a in m.axes] == ["data", "tensor"]
    assert m.axes[1].size == ast.BinOp("*", ast.IntLit(2), ast.IntLit(2))
    assert text(m.axes[1]) == "tensor = 2 * 2"
    assert [s.name.value for s in m.settings] == ["hosts", "device"]
    assert text(m.settings[1].value) == "mygpu"
    assert text(m).startswith("mesh m {") and text(m).endswith("}")


def test_family_params_and_body(module: ast.Module) -> None:
    f = module.items[3]
    assert isinstance(f, ast.FamilyDecl)
    assert [(p.name.value, p.default) for p in f.params][:2] == [("vocab", None), ("hidden", None)]
    assert f.params[2].default == ast.BinOp("*", ast.IntLit(4), ast.Name("hidden"))
    rep = f.body[1]
    assert isinstance(rep, ast.RepeatDecl) and rep.count == ast.IntLit(2)
    attn = rep.body[0]
    assert isinstance(attn, ast.LayerDecl)
    assert attn.call.func.value == "attention"
    assert attn.call.args == (ast.Name("hidden"), ast.IntLit(4))
    assert attn.call.kwargs == (ast.Setting(ast.Name("fused_qkv"), ast.Name("true")),)
    assert text(attn.call) == "attention(hidden, 4, fused_qkv = true)"


def test_models(module: ast.Module) -> None:
    a, b = module.items[4], module.items[5]
    assert isinstance(a, ast.ModelDecl) and a.family == ast.Name("fam") and a.body == ()
    assert [s.name.value for s in a.settings] == ["vocab", "hidden"]
    assert isinstance(b, ast.ModelDecl) and b.family is None
    x = b.body[0]
    assert isinstance(x, ast.LayerDecl)
    # precedence and unary minus: hidden / 2 - -1 == (hidden / 2) - (-1)
    assert x.call.args[1] == ast.BinOp("-", ast.BinOp("/", ast.Name("hidden"), ast.IntLit(2)), ast.Neg(ast.IntLit(1)))
    assert text(x.call.args[1]) == "hidden / 2 - -1"


def test_plan_statements(module: ast.Module) -> None:
    p = module.items[6]
    assert isinstance(p, ast.PlanDecl)
    assert (p.name.value, p.mesh.value, p.model.value) == ("p", "m", "a")
    kinds = [type(s).__name__ for s in p.body]
    assert kinds == ["Setting", "Setting", "LayoutStmt", "ShardStmt", "ShardStmt", "ShardStmt", "LossStmt",
                     "StagesStmt", "ScheduleStmt", "OptimizerStmt"]
    layout = p.body[2]
    assert isinstance(layout, ast.LayoutStmt)
    assert [(e.dim.value, [a.value for a in e.axes]) for e in layout.entries] == [("batch", ["data"]), ("heads", ["tensor", "data"])]
    assert text(layout.entries[1]) == "heads -> tensor * data"


def test_paths_and_rules(module: ast.Module) -> None:
    p = module.items[6]
    s1, s2, s3 = p.body[3], p.body[4], p.body[5]  # type: ignore[attr-defined]
    assert [seg.kind for seg in s1.path.segments] == ["name", "star", "name", "alt"]
    assert s1.path.segments[3].names == ("q", "k")
    assert str(s1.path) == "blocks.*.attn.{q,k}"
    assert text(s1.path) == "blocks.*.attn.{q,k}"
    assert text(s1.path.segments[3]) == "{q,k}"
    assert s2.path.segments[1].kind == "index" and s2.path.segments[1].index == 0
    assert [a.value for a in s2.rule.axes] == ["tensor", "data"]
    assert text(s2.rule) == "row(tensor, data)"
    assert s3.rule.name.value == "replicate" and s3.rule.axes == ()
    assert text(s3.rule) == "replicate"


def test_stages_schedule_optimizer(module: ast.Module) -> None:
    p = module.items[6]
    st = p.body[7]  # type: ignore[attr-defined]
    assert isinstance(st, ast.StagesStmt)
    assert st.axis.value == "data" and st.virtual == ast.IntLit(2) and not st.balanced
    assert [e.index.value for e in st.entries] == [0, 1]
    items = st.entries[0].items
    assert [(i.name.value, i.start, i.stop) for i in items] == [("embed", None, None), ("blocks", 0, 1)]
    assert text(items[1]) == "blocks[0:1]"
    assert st.entries[1].items == ()  # an empty entry parses; the checker reports E0605
    sched = p.body[8]  # type: ignore[attr-defined]
    assert sched.name.value == "interleaved_1f1b"
    opt = p.body[9]  # type: ignore[attr-defined]
    assert isinstance(opt, ast.OptimizerStmt) and opt.name.value == "adamw"
    assert opt.zero is not None and opt.zero.stage.value == 1
    assert [a.value for a in opt.zero.axes] == ["data", "tensor"]
    assert opt.settings == (ast.Setting(ast.Name("lr"), ast.FloatLit("1e-3")),)


def test_balanced_and_bare_optimizer() -> None:
    m = parse("plan p on m for x { stages over pipeline balanced optimizer sgd }")
    plan = m.items[0]
    assert isinstance(plan, ast.PlanDecl)
    st, opt = plan.body
    assert isinstance(st, ast.StagesStmt) and st.balanced and st.entries == ()
    assert isinstance(opt, ast.OptimizerStmt) and opt.zero is None and opt.settings == ()


def test_line_and_column_of_spans(module: ast.Module) -> None:
    mesh = module.items[2]
    assert isinstance(mesh, ast.MeshDecl)
    span = mesh.axes[0].name.span
    assert span is not None and (span.line, span.column) == (4, 10)
    assert str(span) == "full.mesh:4:10"


def test_int_underscores_and_floats() -> None:
    m = parse("model x { a = 1_000, b = 2.5e3, c = 3e2, d = \"s\" }")
    model = m.items[0]
    assert isinstance(model, ast.ModelDecl)
    values = [s.value for s in model.settings]
    assert values == [ast.IntLit(1000), ast.FloatLit("2.5e3"), ast.FloatLit("3e2"), ast.StrLit("s")]


def test_ast_equality_ignores_spans() -> None:
    a = parse("mesh m { axes x = 1 }")
    b = parse("mesh   m {\n  axes x = 1\n}\n")
    assert a == b
    assert a.items[0].span != b.items[0].span  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "src, code, line, col, help_part",
    [
        ("mesh m { axes x = 1 ", "E0101", 1, 21, "`}`"),  # end of file
        ("mesh m { axes x = }", "E0101", 1, 19, "an integer"),
        ("plan p on m for x { shard a: row(t) }", "E0101", 1, 28, "a name"),
        ("mesh m { axes x = 1 $ }", "E0102", 1, 21, "not part of the language"),
        ('include "abc\nmesh m { axes x = 1 }', "E0102", 1, 9, "same line"),
    ],
)
def test_syntax_errors_have_code_span_and_help(src: str, code: str, line: int, col: int, help_part: str) -> None:
    with pytest.raises(SpecError) as info:
        parse(src, "bad.mesh")
    (d,) = info.value.diagnostics
    assert d.code == code
    assert d.span is not None and (d.span.line, d.span.column) == (line, col)
    assert d.help is not None and help_part in d.help


def test_empty_file_parses() -> None:
    assert parse("") == ast.Module(())
    assert parse("# only a comment\n") == ast.Module(())


def test_trailing_comma_after_axes_swallows_the_next_setting_and_is_rejected() -> None:
    # Newlines are not significant, so `axes a = 2, b = 4,` + `hosts = 2` parses `hosts` as a third
    # axis; the checker must reject it instead of building a 3-D mesh of 16 devices.
    from meshllm_dsl.checker import check_text

    module = parse("mesh m {\n    axes a = 2, b = 4,\n    hosts = 2\n}\n")
    mesh = module.items[0]
    assert isinstance(mesh, ast.MeshDecl) and [a.name.value for a in mesh.axes] == ["a", "b", "hosts"]
    result = check_text("mesh m {\n    axes a = 2, b = 4,\n    hosts = 2\n}\n")
    (d,) = result.errors
    assert d.code == "E0204" and d.span is not None and d.span.text == "hosts"
    assert "remove the comma" in (d.help or "")


@pytest.mark.parametrize(
    "src",
    [
        "mesh m { axes a = 1  zero = 2 }",  # `zero` is the optimizer keyword
        "model x { a = 1  stages = 2  shard = 3  loss = 4  axes = 5 }",  # plan / mesh keywords
    ],
)
def test_keywords_used_as_names_after_an_expression(src: str) -> None:
    # Found by the thorough fmt round-trip property: LALR's merged lookaheads made the contextual
    # lexer read these names as keywords only after an expression (so fmt, which moves mesh settings
    # after the axes, produced text that no longer parsed).
    module = parse(src)
    names = [s.name.value for s in module.items[0].settings]  # type: ignore[union-attr]
    assert names[-1] in ("zero", "axes")
    from meshllm_dsl.front.fmt import format_text

    assert parse(format_text(src)) == module
