"""Placements per mesh axis (meshllm_dsl/parallel/placements.py): layouts, parameter placements, and the
placements torch would print for them."""

from __future__ import annotations

import pytest
from mesh_snippets import MEGATRON

from meshllm_dsl.checker import check_text
from meshllm_dsl.ir import Placement, Tensor, param_dims
from meshllm_dsl.parallel.placements import (
    Layout,
    Partial,
    Replicate,
    Shard,
    activation_dims,
    dtensor_placements,
    dtensor_text,
    fsdp_axes,
)


def test_a_layout_places_each_axis_on_its_own() -> None:
    # [b, s / cp, h / tp]: what context parallelism next to tensor parallelism needs
    cp_tp = Layout((("cp", Shard("seq")), ("tensor", Shard("hidden"))))
    assert cp_tp.on("cp") == Shard("seq") and cp_tp.on("tensor") == Shard("hidden") and cp_tp.on("data") == Replicate()
    assert str(cp_tp) == "Shard(seq) over cp, Shard(hidden) over tensor"
    assert dtensor_placements(cp_tp, (("data", 2), ("cp", 2), ("tensor", 4)), activation_dims()) == (
        "Replicate()", "Shard(dim=1)", "Shard(dim=2)")
    # Replicate is what an absent axis means: one spelling, so equal layouts compare equal
    assert Layout((("data", Replicate()), ("tensor", Partial()))) == Layout.partial(("tensor",))
    assert str(Layout()) == "Replicate()" and Layout().replicated
    assert Layout.shard("heads", ("a", "b")).feature_axes() == ("a", "b")
    assert Layout.shard("seq", ("a",)).feature_axes() == () and Layout.shard("seq", ("a",)).sharded_axes() == ("a",)
    with pytest.raises(ValueError, match="twice"):
        Layout.shard("seq", ("a",)).then(Layout.shard("hidden", ("a",)))


def test_shards_of_one_dim_split_in_mesh_order_or_strided() -> None:
    mesh = (("a", 2), ("b", 4))
    dims = ("rows", "cols")
    # split a then b (a outermost), as torch nests them: plain shards
    assert dtensor_placements(Layout.shard("rows", ("a", "b")), mesh, dims) == ("Shard(dim=0)", "Shard(dim=0)")
    # split b first: a's shard lies inside b's, torch's _StridedShard with b's size
    assert dtensor_placements(Layout.shard("rows", ("b", "a")), mesh, dims) == ("_StridedShard(dim=0, sf=4)", "Shard(dim=0)")
    # different dims do not nest
    assert dtensor_placements(Layout((("b", Shard("rows")), ("a", Shard("cols")))), mesh, dims) == (
        "Shard(dim=1)", "Shard(dim=0)")
    with pytest.raises(ValueError, match="Shard\\(seq\\)"):
        dtensor_placements(Layout.shard("seq", ("a",)), mesh, dims)


def test_parameter_placements_per_rule() -> None:
    w = Tensor("weight", (64, 32), ((("heads", 4),), (("hidden", 32),)))
    bias = Tensor("bias", (64,), ((("heads", 4),),))
    mesh = (("data", 2), ("tensor", 2))

    def placed(p: Placement, t: Tensor, fsdp: tuple[str, ...] = ()) -> tuple[str, ...]:
        return dtensor_placements(p.layout(t, fsdp), mesh, param_dims(t))

    column, row = Placement("column", ("tensor",)), Placement("row", ("tensor",))
    assert placed(column, w) == ("Replicate()", "Shard(dim=0)")  # torch weight (out, in)
    assert placed(column, bias) == ("Replicate()", "Shard(dim=0)")
    assert placed(row, w) == ("Replicate()", "Shard(dim=1)")
    assert placed(row, bias) == ("Replicate()", "Replicate()")  # added once, after the sum
    assert placed(Placement("vocab_parallel", ("tensor",)), w) == ("Replicate()", "Shard(dim=0)")
    assert placed(Placement("replicate"), w) == ("Replicate()", "Replicate()")
    # FSDP2 shards each tensor-parallel shard again along dim 0: inside the tensor split
    assert placed(column, w, ("data",)) == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    assert placed(row, w, ("data",)) == ("Shard(dim=0)", "Shard(dim=1)")
    assert placed(Placement("replicate"), bias, ("data",)) == ("Shard(dim=0)", "Replicate()")
    assert str(column.layout(w, ("data",))) == "Shard(heads) over tensor x data"
    square = Tensor("weight", (32, 32), ((("hidden", 32),), (("hidden", 32),)))
    assert param_dims(square) == ("hidden (dim 0)", "hidden (dim 1)")
    assert placed(row, square) == ("Replicate()", "Shard(dim=1)")


TWO_D = """
mesh m {{ axes data = 2, tensor = 2 }}
model t = llama {{ vocab = 256, hidden = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 128 }}
plan p on m for t {{
{body}
    layout {{ batch -> data }}
    optimizer adamw {{ zero {zero} over data }}
}}
"""


@pytest.mark.parametrize(("zero", "fsdp"), [(1, ()), (2, ("data",)), (3, ("data",))])
def test_fsdp_shards_parameters_from_zero_2(zero: int, fsdp: tuple[str, ...]) -> None:
    result = check_text(TWO_D.format(body=MEGATRON, zero=zero))
    assert result.ok, [d.message for d in result.errors]
    assert fsdp_axes(result.plans["p"]) == fsdp  # ZeRO 1 shards optimizer states only


def test_reprs_are_torchs() -> None:
    tensor = pytest.importorskip("torch.distributed.tensor")
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = (("a", 2), ("b", 2), ("c", 2), ("d", 2))
    layout = Layout((("d", Shard("x")), ("b", Partial()), ("c", Shard("x"))))
    assert dtensor_placements(layout, mesh, ("w", "x")) == tuple(
        repr(p) for p in (tensor.Replicate(), tensor.Partial(), _StridedShard(1, split_factor=2), tensor.Shard(1)))
    assert dtensor_text(("Shard(dim=2)",)) == f"placements={(tensor.Shard(2),)!r}"


def test_explain_text_prints_placements_in_mesh_order() -> None:
    from meshllm_dsl.views.explain import explain_text

    text = explain_text(check_text(TWO_D.format(body=MEGATRON + "    layout { seq -> tensor }", zero=3)).plans["p"])
    assert "placements as DTensor's over (data, tensor))" in text
    assert "input   placements=(Shard(dim=0), Shard(dim=1))  # Shard(batch) over data, Shard(seq) over tensor" in text
    assert "q       placements=(Shard(dim=0), Shard(dim=2))  # Shard(batch) over data, Shard(heads) over tensor" in text
    assert "o       placements=(Shard(dim=0), Partial(sum))  # Shard(batch) over data, Partial(sum) over tensor" in text
    assert ("q.weight  (64, 64)  (32, 64)  column(tensor)  placements=(_StridedShard(dim=0, sf=2), Shard(dim=0))"
            "  # Shard(heads) over tensor x data") in text


def test_explain_of_a_pipeline_only_mesh_prints_no_placements() -> None:
    from helpers import EXAMPLES

    from meshllm_dsl.checker import check_file
    from meshllm_dsl.views.explain import explain_text

    (plan,) = check_file(EXAMPLES / "seed_pipeline_12.mesh").plans.values()
    text = explain_text(plan)
    assert "every tensor whole on its stage" in text and "placements=" not in text
