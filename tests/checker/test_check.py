"""Checker: placements, block classes, stage maps, layout flows and the collectives they imply."""

from __future__ import annotations

import pytest
from helpers import EXAMPLES
from mesh_snippets import MEGATRON

from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.ir import Collective, PlanIR, StagePiece
from meshllm_dsl.parallel.placements import Layout, Partial, Replicate, Shard

TP = Collective  # shorthand


def plan_of(src: str, name: str = "p") -> PlanIR:
    result = check_text(src)
    assert result.ok, [(d.code, d.message, d.span and d.span.text) for d in result.errors]
    return result.plans[name]


def codes(src: str) -> list[str]:
    return sorted(d.code for d in check_text(src).diagnostics)


TINY = """
mesh m {{ axes {axes} }}
model t = llama {{ vocab = 256, hidden = 64, layers = {layers}, heads = 4, kv_heads = 2, ffn = 128 }}
plan p on m for t {{
{body}
}}
"""


def tiny(body: str, axes: str = "tensor = 2", layers: int = 4) -> str:
    return TINY.format(axes=axes, layers=layers, body=body)


# ---------------------------------------------------------------- placements and flows


def test_megatron_plan_placements_and_collectives() -> None:
    p = plan_of(tiny(MEGATRON))
    (cls,) = p.block_classes
    assert cls.indices == (0, 1, 2, 3)
    assert cls.placement("attn.q").rule == "column" and cls.placement("attn.q").axes == ("tensor",)
    assert cls.placement("attn.o").rule == "row"
    assert cls.placement("attn_norm").rule == "replicate"
    attn = cls.flow("attn")
    # Megatron f before the column layers, g after the row layer; the residual stream stays replicated
    assert attn.collectives == (TP("copy_to", ("tensor",), "input"), TP("reduce_from", ("tensor",), "output"))
    assert attn.input == attn.output == Layout()
    # inside: q / k / v shard the heads over tensor, o leaves a partial sum that reduce_from adds up
    assert dict(attn.inside) == {**{x: Layout.shard("heads", ("tensor",)) for x in "qkv"}, "o": Layout.partial(("tensor",))}
    assert dict(cls.flow("mlp").inside)["up"] == Layout((("tensor", Shard("ffn")),))
    assert dict(attn.inside)["o"].on("tensor") == Partial() and attn.output.on("tensor") == Replicate()
    assert cls.flow("attn_norm").collectives == ()
    top = dict(p.top_flows)
    assert top["embed"].collectives == (TP("reduce_from", ("tensor",), "output"),)
    assert top["lm_head"].output == Layout.shard("vocab", ("tensor",))  # logits stay sharded over the vocabulary
    assert p.roles.loss == ("tensor",)
    assert p.placement("blocks.3.mlp.down").rule == "row"
    assert p.placement("lm_head").rule == "column"


def test_sequence_parallel_plan_flows_and_explain() -> None:
    from meshllm_dsl.views.explain import explain_json

    p = plan_of(tiny(MEGATRON + "    layout { seq -> tensor }\n    seq = 16"))
    assert p.roles.sequence == ("tensor",)
    (cls,) = p.block_classes
    sp = Layout.shard("seq", ("tensor",))
    assert str(sp) == "Shard(seq) over tensor"
    # f / g become all-gather / reduce-scatter along the sequence; norms and the stream are Shard(seq)
    for unit in ("attn", "mlp"):
        flow = cls.flow(unit)
        assert flow.collectives == (TP("gather_seq", ("tensor",), "input"), TP("reduce_scatter_seq", ("tensor",), "output"))
        assert flow.input == flow.output == sp
    assert cls.flow("attn_norm").input == sp
    top = dict(p.top_flows)
    assert top["embed"].collectives == (TP("reduce_scatter_seq", ("tensor",), "output"),)
    assert top["norm"].input == sp
    assert top["lm_head"].collectives == (TP("gather_seq", ("tensor",), "input"),)
    assert top["lm_head"].output == Layout.shard("vocab", ("tensor",))
    units = {u["name"]: u for e in explain_json(p)["layers"] for u in e["units"]}
    assert units["attn_norm"]["params"][0]["grad_summed_over"] == ["tensor"]
    assert "grad_summed_over" not in units["attn"]["params"][0]
    assert any("reduce-scatter(seq) forward" in c for c in units["mlp"]["collectives"])


def test_sequence_parallel_without_sequence_parallel_plan_is_unchanged() -> None:
    assert plan_of(tiny(MEGATRON)).roles.sequence == ()


@pytest.mark.parametrize(("body", "code"), [
    (MEGATRON + "    layout { seq -> tensor }\n    seq = 15", "E0301"),
    # Over an axis that splits no weight, `seq -> AXIS` is context parallelism (tests/context).
    ("    layout { seq -> tensor }\n    layout { batch -> data }", None),
    (MEGATRON.replace("mlp.down row(tensor)", "mlp.down replicate").replace("mlp.{gate,up} column(tensor)",
                                                                             "mlp.{gate,up} replicate")
     + "    layout { seq -> tensor }", "E0410"),
    (MEGATRON + "    layout { seq -> tensor }\n    layout { batch -> data }", None),
])
def test_sequence_parallel_errors(body: str, code: str | None) -> None:
    got = codes(tiny(body, axes="data = 2, tensor = 2"))
    assert got == ([code] if code else []), got


def test_row_layer_fed_replicated_input_splits_it() -> None:
    # A row layer after a replicated layer scatters its input (split_to) and sums its output.
    body = MEGATRON.replace("shard blocks.*.mlp.{gate,up} column(tensor)", "shard blocks.*.mlp.{gate,up} replicate")
    result = check_text(tiny(body))
    # gate/up replicated then down row: valid (input is split locally), with split_to + reduce_from
    assert result.ok, [(d.code, d.message) for d in result.errors]
    mlp = result.plans["p"].block_classes[0].flow("mlp")
    assert mlp.collectives == (TP("split_to", ("tensor",), "input"), TP("reduce_from", ("tensor",), "output"))


def test_replicated_plan_has_no_collectives() -> None:
    p = plan_of(tiny("    batch = 4", axes="data = 1"))
    assert all(f.collectives == () for c in p.block_classes for _, f in c.flows)
    assert p.roles.loss == ()


def test_block_exceptions_make_block_classes() -> None:
    body = MEGATRON.replace(
        "shard blocks.*.mlp.down row(tensor)", "shard blocks.{0-0}.mlp.down row(tensor)"
    )  # invalid path syntax on purpose? no: use explicit indices below
    body = MEGATRON.replace("    shard blocks.*.mlp.{gate,up} column(tensor)\n    shard blocks.*.mlp.down row(tensor)\n", "")
    body += "    shard blocks.*.mlp.{gate,up} replicate\n    shard blocks.*.mlp.down replicate\n"
    p = plan_of(tiny(body))
    assert len(p.block_classes) == 1 and p.block_classes[0].placement("mlp.down").rule == "replicate"
    # Now a per-block rule for block 2 only: two classes, {0,1,3} and {2}
    body2 = MEGATRON.replace("    shard blocks.*.mlp.down row(tensor)\n", "    shard blocks.0.mlp.down row(tensor)\n"
                             "    shard blocks.1.mlp.down row(tensor)\n    shard blocks.2.mlp.down row(tensor)\n"
                             "    shard blocks.3.mlp.down row(tensor)\n")
    p2 = plan_of(tiny(body2))
    assert [c.indices for c in p2.block_classes] == [(0, 1, 2, 3)]


def test_per_block_placement_differs() -> None:
    body = MEGATRON.replace("shard blocks.*.attn.{q,k,v} column(tensor)\n    shard blocks.*.attn.o row(tensor)",
                            "shard blocks.{q}.attn.q column(tensor)")
    assert "E0502" in codes(tiny(body))  # `blocks.{q}` names no repeat: matches nothing
    body = MEGATRON.replace(
        "shard blocks.*.attn.{q,k,v} column(tensor)\n    shard blocks.*.attn.o row(tensor)",
        "shard blocks.0.attn.{q,k,v} replicate\n    shard blocks.0.attn.o replicate\n"
        "    shard blocks.1.attn.{q,k,v} column(tensor)\n    shard blocks.1.attn.o row(tensor)\n"
        "    shard blocks.2.attn.{q,k,v} column(tensor)\n    shard blocks.2.attn.o row(tensor)\n"
        "    shard blocks.3.attn.{q,k,v} replicate\n    shard blocks.3.attn.o replicate",
    )
    p = plan_of(tiny(body))
    assert [c.indices for c in p.block_classes] == [(0, 3), (1, 2)]
    assert p.placement("blocks.0.attn.q").rule == "replicate"
    assert p.placement("blocks.2.attn.q").rule == "column"
    assert p.block_class("blocks", 3).flow("attn").collectives == ()


def test_layout_rules_equal_shard_rules() -> None:
    layout = "    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }"
    a, b = plan_of(tiny(layout)), plan_of(tiny(MEGATRON))
    assert [c.placements for c in a.block_classes] == [c.placements for c in b.block_classes]  # spans ignored
    assert a.block_classes[0].flows == b.block_classes[0].flows
    assert dict(a.top_placements) == dict(b.top_placements)


@pytest.mark.parametrize(
    "change, code",
    [
        (("shard blocks.*.mlp.down row(tensor)", "shard blocks.*.mlp.down column(tensor)"), "E0402"),
        (("shard blocks.*.attn.{q,k,v} column(tensor)", "shard blocks.*.attn.{q,k,v} row(tensor)"), "E0403"),
        (("shard blocks.*.mlp.{gate,up} column(tensor)", "shard blocks.*.mlp.gate column(tensor)\n shard blocks.*.mlp.up row(tensor)"), "E0403"),
        (("shard blocks.*.attn.{q,k,v} column(tensor)", "shard blocks.*.attn.{q,k} column(tensor)\n shard blocks.*.attn.v replicate"), "E0402"),
        (("shard blocks.*.attn.o row(tensor)", "shard blocks.*.attn.o replicate"), "E0402"),
        (("shard lm_head column(tensor)", "shard lm_head row(tensor)"), "E0404"),
        (("shard lm_head column(tensor)", "shard lm_head column(tensor)\n loss cross_entropy"), "E0404"),
        (("shard lm_head column(tensor)", "shard lm_head replicate\n loss vocab_parallel(tensor)"), "E0404"),
        (("shard lm_head column(tensor)", "shard lm_head column(tensor)\n loss hinge"), "E0406"),
        (("shard embed vocab_parallel(tensor)", "shard embed column(tensor)"), "E0405"),
        (("shard lm_head column(tensor)", "shard lm_head vocab_parallel(tensor)"), "E0405"),
        (("shard lm_head column(tensor)", "shard lm_head column(tensor)\n shard norm row(tensor)"), "E0405"),
        (("shard lm_head column(tensor)", "shard lm_head replicate(tensor)"), "E0406"),
        (("shard lm_head column(tensor)", "shard lm_head column"), "E0406"),
        (("shard lm_head column(tensor)", "shard lm_head column(tensor, tensor)"), "E0401"),
        (("shard lm_head column(tensor)", "shard lm_head column(tensr)"), "E0202"),
        (("shard lm_head column(tensor)", ""), "E0501"),
        (("shard lm_head column(tensor)", "shard lm_head column(tensor)\n shard lm_head replicate"), "E0503"),
        (("shard lm_head column(tensor)", "shard lm_head column(tensor)\n shard blocks.9.mlp.up replicate"), "E0502"),
        (("shard lm_head column(tensor)", "shard lm_head column(tensor)\n shard {norm,nrm} replicate"), "E0502"),
        (("shard lm_head column(tensor)", "shard lm_head column(tensor)\n shard blocks.*.mlp replicate"), "E0502"),
    ],
)
def test_placement_errors_exactly_once(change: tuple[str, str], code: str) -> None:
    body = MEGATRON.replace(*change)
    assert body != MEGATRON or not change[0]
    found = [d for d in check_text(tiny(body)).errors]
    assert [d.code for d in found] == [code], [(d.code, d.message) for d in found]
    assert found[0].span is not None and found[0].help


def test_composite_pattern_help_lists_its_layers() -> None:
    body = MEGATRON + "    shard blocks.*.mlp replicate\n"
    (d,) = check_text(tiny(body)).errors
    assert d.code == "E0502" and "{gate,up,down}" in (d.help or "")


def test_divisibility_help_lists_valid_sizes() -> None:
    # heads 4, kv_heads 2: one error per rule (q,k,v column and o row), not one per parameter
    d, o = check_text(tiny(MEGATRON, axes="tensor = 8")).errors
    assert o.code == "E0301" and o.span is not None and o.span.text == "row(tensor)"
    assert o.help == "tensor must divide 4 heads (and 2 kv_heads, split over it by other rules): use 1 or 2"
    assert d.code == "E0301"
    assert d.message == "`heads` (4) and `kv_heads` (2) are not divisible by tensor (8)"
    assert d.help == "tensor must divide 4 heads and 2 kv_heads: use 1 or 2"
    assert d.span is not None and d.span.text == "column(tensor)"


def test_divisibility_of_vocab_suggests_padding() -> None:
    src = TINY.replace("vocab = 256", "vocab = 250").format(axes="tensor = 4", layers=2, body=MEGATRON.replace("kv_heads", "heads"))
    src = src.replace("kv_heads = 2", "kv_heads = 4")
    errors = check_text(src).errors
    assert {d.code for d in errors} == {"E0301"}
    assert any("pad `vocab` to 252" in (d.help or "") and "`vocab = 252, vocab_used = 250`" in (d.help or "") for d in errors)
    # and the padding the help names checks clean
    assert check_text(src.replace("vocab = 250", "vocab = 252, vocab_used = 250")).ok


def test_tied_weights() -> None:
    gpt = """
mesh m { axes tensor = 2 }
model g = gpt2 { vocab = 256, hidden = 64, layers = 2, heads = 4, positions = 64 }
plan p on m for g {
    shard blocks.*.attn.qkv column(tensor)
    shard blocks.*.attn.o row(tensor)
    shard blocks.*.mlp.up column(tensor)
    shard blocks.*.mlp.down row(tensor)
    shard pos replicate
    shard embed vocab_parallel(tensor)
    shard lm_head HEAD
}
"""
    assert check_text(gpt.replace("HEAD", "column(tensor)")).ok
    errs = check_text(gpt.replace("HEAD", "replicate")).errors
    assert [d.code for d in errs] == ["E0408"]


# ---------------------------------------------------------------- pipeline


def test_seed_twelve_layers_on_three_stages() -> None:
    plan = check_file(EXAMPLES / "seed_pipeline_12.mesh").plans["pipeline12"]
    blocks = [(pc.start, pc.stop) for s in plan.stages for pc in s.pieces if pc.item == "blocks"]
    assert blocks == [(0, 4), (4, 8), (8, 12)]  # blocks 0-3, 4-7, 8-11
    assert [s.coord for s in plan.stages] == [0, 1, 2]
    assert plan.stages[0].pieces[:2] == (StagePiece("embed"), StagePiece("pos"))
    assert [pc.item for pc in plan.stages[2].pieces] == ["blocks", "norm", "lm_head"]
    assert plan.roles.pipeline == "pipeline" and plan.pipeline_size == 3 and plan.schedule == "gpipe"


def test_balanced_stages_and_interleaving() -> None:
    p = plan_of(tiny("    microbatches = 4\n    stages over pipeline balanced", axes="pipeline = 2"))
    assert [[(pc.item, pc.start, pc.stop) for pc in s.pieces] for s in p.stages] == [
        [("embed", None, None), ("blocks", 0, 2)],
        [("blocks", 2, 4), ("norm", None, None), ("lm_head", None, None)],
    ]
    assert p.schedule == "1f1b"  # the default with a pipeline
    v = plan_of(tiny("    microbatches = 4\n    stages over pipeline virtual 2 balanced", axes="pipeline = 2"))
    assert v.schedule == "interleaved_1f1b" and v.virtual == 2
    assert [s.coord for s in v.stages] == [0, 1, 0, 1]
    assert [(s.pieces[-1].start if s.pieces[-1].item == "blocks" else s.pieces[0].start) for s in v.stages] == [0, 1, 2, 3]


STAGES = """    microbatches = 4
    stages over pipeline {{
{entries}
    }}"""


@pytest.mark.parametrize(
    "entries, code, span_text",
    [
        ("0: embed, blocks[0:2]\n1: blocks[2:4], norm, lm_head", None, None),
        ("0: embed, blocks[0:2]\n1: blocks[2:3], norm, lm_head", "E0601", None),  # gap 3 (then norm)
        ("0: embed, blocks[0:2]\n1: blocks[2:4], norm", "E0601", "norm"),
        ("0: embed, blocks[0:2]\n1: blocks[2:4]", "E0601", "blocks[2:4]"),
        ("0: embed, blocks[0:3]\n1: blocks[2:4], norm, lm_head", "E0602", "blocks[2:4]"),
        ("0: embed, norm, blocks[0:2]\n1: blocks[2:4], lm_head", "E0603", "norm"),
        ("0: embed, blocks[2:4]\n1: blocks[0:2], norm, lm_head", "E0603", "blocks[2:4]"),
        ("1: embed, blocks[0:2]\n0: blocks[2:4], norm, lm_head", "E0603", "1"),
        ("1: blocks[2:4], norm, lm_head\n0: embed, blocks[0:2]", "E0603", "1"),
        ("0: embed, blocks[0:4], norm, lm_head", "E0604", "stages over pipeline"),
        ("0: embed, blocks[0:1]\n1: blocks[1:2]\n2: blocks[2:4], norm, lm_head", "E0604", "stages over pipeline"),
        ("0: embed, blocks[0:4], norm, lm_head\n1:", "E0605", "1:"),
        ("0: embed, blocks[0:5]\n1: norm, lm_head", "E0609", "blocks[0:5]"),
        ("0: embed[0:1], blocks[0:2]\n1: blocks[2:4], norm, lm_head", "E0609", "embed[0:1]"),
        ("0: embed, blocks[0:2]\n1: blocks[2:4], norm, head", "E0202", "head"),
    ],
)
def test_stage_maps(entries: str, code: str | None, span_text: str | None) -> None:
    src = tiny(STAGES.format(entries=entries), axes="pipeline = 2")
    errs = check_text(src).errors
    if code is None:
        assert errs == []
        return
    # exactly the one mistake, no cascade (a gap that also leaves norm unplaced is two E0601s)
    assert {d.code for d in errs} == {code}, [(d.code, d.message) for d in errs]
    assert len(errs) == 1 or code == "E0601", [(d.code, d.message) for d in errs]
    if span_text is not None:
        assert any(d.span is not None and span_text.startswith(d.span.text) for d in errs), [d.span and d.span.text for d in errs]


@pytest.mark.parametrize(
    "body, axes, expected",
    [
        ("microbatches = 2\n stages over pipeline balanced\n schedule 1f1b", "pipeline = 4", ["E0606"]),
        ("stages over pipeline balanced", "pipeline = 2", ["E0606"]),  # microbatches unset = 1
        ("microbatches = 2\n stages over pipeline balanced\n schedule gpipe", "pipeline = 4", ["W0703"]),
        ("microbatches = 4\n stages over pipeline balanced\n schedule interleaved_1f1b", "pipeline = 2", ["E0607"]),
        ("microbatches = 4\n stages over pipeline virtual 2 balanced\n schedule gpipe", "pipeline = 2", ["E0607"]),
        ("microbatches = 3\n stages over pipeline virtual 2 balanced", "pipeline = 2", ["E0606"]),
        ("microbatches = 4\n stages over pipeline balanced\n schedule zero_bubble", "pipeline = 2", ["E0607"]),
        ("microbatches = 8\n stages over pipeline balanced", "pipeline = 8", ["E0608"]),
        ("microbatches = 4\n stages over pipe balanced", "pipeline = 2", ["E0202"]),
        ("batch = 6\n microbatches = 4\n layout { batch -> data }\n stages over pipeline balanced", "data = 2, pipeline = 2", ["E0305"]),
        ("batch = 8\n microbatches = 4\n layout { batch -> pipeline }\n stages over pipeline balanced", "pipeline = 2", ["E0407"]),
        ("layout { batch -> data }\n optimizer adamw { zero 1 over tensor }", "data = 2, tensor = 1", ["E0407"]),
        ("optimizer adamw { zero 1 }", "data = 1", ["E0407"]),
        ("layout { batch -> data }\n optimizer adamw { zero 4 }", "data = 2", ["E0203"]),
        ("layout { batch -> data }\n optimizer lion", "data = 2", ["E0203"]),
        ("layout { batch -> data }\n optimizer adamw { lr = fast }", "data = 2", ["E0304"]),
        ("layout { batch -> data }\n batch = 4\n batch = 8", "data = 2", ["E0201"]),
        ("layout { batch -> data, batch -> data }", "data = 2", ["E0201"]),
        ("layout { batch -> data }\n seq = 0", "data = 2", ["E0303"]),
        ("layout { batch -> data }", "data = 2, tensor = 2", ["W0704"]),
        ("layout { batch -> data, hiden -> data }", "data = 2", ["E0502"]),
    ],
)
def test_plan_level_checks(body: str, axes: str, expected: list[str]) -> None:
    found = codes(tiny("    " + body, axes=axes))
    assert found == expected


def test_tensor_axis_across_hosts_warns_and_within_host_does_not() -> None:
    across = tiny(MEGATRON + "    layout { batch -> data }", axes="tensor = 2, data = 4 hosts = 2")
    within = tiny(MEGATRON + "    layout { batch -> data }", axes="data = 4, tensor = 2 hosts = 2")
    assert codes(across) == ["W0702"]
    assert codes(within) == []


def test_stage_imbalance_warning() -> None:
    src = tiny("    microbatches = 4\n    stages over pipeline {\n 0: embed, blocks[0:3]\n 1: blocks[3:4], norm, lm_head\n }",
               axes="pipeline = 2")
    (w,) = check_text(src).diagnostics
    assert w.code == "W0701" and w.span is not None and w.span.text.startswith("0: embed")


def test_all_diagnostics_at_once() -> None:
    # Independent mistakes in one plan are all reported, in source order.
    body = MEGATRON.replace("shard blocks.*.mlp.down row(tensor)", "shard blocks.*.mlp.down column(tensor)")
    body = body.replace("shard lm_head column(tensor)", "shard lm_head row(tensor)")
    body += "    batch = 3\n    layout { batch -> data }\n"
    found = codes(tiny(body, axes="data = 2, tensor = 2"))
    assert found == ["E0305", "E0402", "E0404"]


def test_unknown_mesh_and_model_in_plan_header() -> None:
    src = "mesh m { axes a = 1 }\nmodel t = gpt2 { hidden = 8, layers = 1, heads = 2 }\nplan p on mm for tt { }"
    assert codes(src) == ["E0202", "E0202"]


def test_duplicate_plans_and_meshes() -> None:
    src = "mesh m { axes a = 1 }\nmesh m { axes a = 1 }\nplan q on m for t { }\nplan q on m for t { }"
    assert codes(src) == ["E0201", "E0201", "E0202"]  # mesh twice, plan twice, model `t` unknown


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.mesh")), ids=lambda p: p.stem)
def test_examples_yield_plans_with_consistent_stage_maps(path) -> None:  # type: ignore[no-untyped-def]
    result = check_file(path)
    for plan in result.plans.values():
        for rep in plan.model.repeats:
            covered = sorted(b for s in plan.stages for pc in s.pieces if pc.item == rep.name
                             for b in range(pc.start or 0, pc.stop or 0))
            assert covered == list(range(rep.count))
            assert sorted(b for c in plan.classes_of(rep.name) for b in c.indices) == list(range(rep.count))
        assert sum(s.numel for s in plan.stages) >= plan.model.numel
        assert {c.repeat for c in plan.block_classes} == {r.name for r in plan.model.repeats}


@pytest.mark.parametrize(
    "extra, where",
    [
        ("shard blocks.2.mlp.down replicate", "blocks.2.mlp.down"),  # a block rule under an all-blocks rule
        ("shard blocks.*.mlp.down replicate", "blocks.*.mlp.down"),
    ],
)
def test_overlap_names_the_shared_blocks(extra: str, where: str) -> None:
    (d,) = check_text(tiny(MEGATRON + f"    {extra}\n")).errors
    assert d.code == "E0503" and d.message == f"`{where}` is matched by two rules"
    assert d.span is not None and d.span.text == extra
    assert d.secondary[0].span.text == "shard blocks.*.mlp.down row(tensor)"


def test_per_block_rules_overlap_only_where_they_share_blocks() -> None:
    body = MEGATRON.replace("    shard blocks.*.mlp.down row(tensor)\n", "".join(
        f"    shard blocks.{i}.mlp.down row(tensor)\n" for i in range(4)))
    assert check_text(tiny(body)).ok  # four disjoint per-block rules cover the leaf exactly once
    (d,) = check_text(tiny(body + "    shard blocks.1.mlp.down row(tensor)\n")).errors
    assert d.code == "E0503" and "`blocks.1.mlp.down`" in d.message


def test_multi_axis_rules_come_out_in_mesh_order() -> None:
    # chunk index (mesh.index) and group rank (torch orders members by global rank) agree only
    # in mesh order, so the checker normalises `column(b, a)` on a mesh `a, b` to (a, b)
    body = MEGATRON.replace("mlp.{gate,up} column(tensor)", "mlp.{gate,up} column(tensor, data)")
    body = body.replace("mlp.down row(tensor)", "mlp.down row(tensor, data)")
    p = plan_of(tiny(body, axes="data = 2, tensor = 2"))
    assert p.placement("blocks.0.mlp.up").axes == ("data", "tensor")
    assert p.placement("blocks.0.mlp.down").axes == ("data", "tensor")


RECOMPUTE_PLAN = """
mesh m { axes tensor = 2 }
model l = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64 }
plan p on m for l {
    recompute = REGION
    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
}
"""


@pytest.mark.parametrize("region", ["none", "blocks", "attention"])
def test_recompute_regions_check_format_and_reach_the_ir(region: str) -> None:
    from meshllm_dsl.front.fmt import format_text
    from meshllm_dsl.front.parser import parse

    src = RECOMPUTE_PLAN.replace("REGION", region)
    assert plan_of(src).recompute == region
    assert parse(format_text(src)) == parse(src)
    assert f"recompute = {region}" in format_text(src)


def test_recompute_unset_is_none_and_bad_uses_are_refused() -> None:
    assert plan_of(RECOMPUTE_PLAN.replace("    recompute = REGION\n", "")).recompute == "none"
    assert codes(RECOMPUTE_PLAN.replace("REGION", "full")) == ["E0203"]
    assert codes(RECOMPUTE_PLAN.replace("REGION", '"blocks"')) == ["E0203"]
    inline = """
mesh m { axes data = 1 }
model x { hidden = 8  vocab = 16  embed = embedding(vocab, hidden)  lm_head = linear(hidden, vocab) }
plan p on m for x { recompute = REGION }
"""
    assert codes(inline.replace("REGION", "blocks")) == ["E0409"]
    assert codes(inline.replace("REGION", "attention")) == ["E0409"]
