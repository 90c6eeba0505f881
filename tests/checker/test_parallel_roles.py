"""ParallelRoles: which mesh axes play which parallel role, validated where the record is built."""

from __future__ import annotations

import attrs
import pytest
from helpers import EXAMPLES
from mesh_snippets import MEGATRON

from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.ir import Axis, MeshIR
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.parallel.roles import ParallelRoles
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.report import report_json

R = ParallelRoles
DATA_PIPE_TP = dict(pipeline="pipeline", batch=("data",), tensor=("tensor",), loss=("tensor",))

# What each example's spec says, read off its `axes`, `layout`, `shard`, `stages` and `zero` lines
# (the loss is vocab-parallel wherever the head is column-parallel).
EXAMPLE_ROLES = {
    ("gpt2_small.mesh", "train"): R(batch=("data",), tensor=("tensor",), loss=("tensor",)),
    ("llama2_70b.mesh", "train"): R(pipeline="pipeline", tensor=("tensor",), loss=("tensor",)),
    ("llama2_70b_2x8.mesh", "train"): R(**DATA_PIPE_TP, batch_shard=("data",)),
    ("llama2_70b_train.mesh", "train"): R(pipeline="pipeline", tensor=("tensor",), loss=("tensor",)),
    ("llama2_70b_train.mesh", "train_64"): R(**DATA_PIPE_TP, batch_shard=("data",), sequence=("tensor",)),
    ("llama2_7b.mesh", "train"): R(batch=("data",), batch_shard=("data",), tensor=("tensor",), loss=("tensor",)),
    ("seed_mesh_2d.mesh", "seed"): R(pipeline="pipeline", tensor=("tensor",), loss=("tensor",)),
    ("seed_pipeline_12.mesh", "pipeline12"): R(pipeline="pipeline"),
    ("tiny_gpt2.mesh", "train"): R(pipeline="pipeline", tensor=("tensor",), sequence=("tensor",), loss=("tensor",)),
    ("tiny_llama.mesh", "train"): R(**DATA_PIPE_TP, batch_shard=("data",)),
    ("tiny_llama_fsdp.mesh", "train"): R(**DATA_PIPE_TP, batch_shard=("data",)),
    ("tiny_llama_fp8.mesh", "train"): R(**DATA_PIPE_TP, batch_shard=("data",)),
    ("tiny_mixtral.mesh", "train"): R(batch=("data",), tensor=("tensor",), loss=("tensor",)),
    ("tiny_mixtral_experts.mesh", "train"): R(batch=("data",), tensor=("tensor",), loss=("tensor",), expert=("data",)),
    # DeepSeek-V3's published layout: ZeRO 1 over both batch axes, the experts over the in-host-spanning `data`
    ("deepseek_v3_671b.mesh", "train"): R(pipeline="pipeline", batch=("replica", "data"),
                                          batch_shard=("replica", "data"), expert=("data",)),
    ("tiny_mla.mesh", "train"): R(tensor=("tensor",), loss=("tensor",), context=("cp",)),
    ("tiny_deepseek.mesh", "train"): R(batch=("data",), tensor=("tensor",), loss=("tensor",), expert=("data",)),
    # the experts over data x context, and over data x tensor (each tensor rank routing half the tokens)
    ("tiny_deepseek_experts.mesh", "context"): R(batch=("data",), context=("context",), expert=("data", "context")),
    ("tiny_deepseek_experts.mesh", "tensor"): R(batch=("data",), tensor=("tensor",), loss=("tensor",),
                                                expert=("data", "tensor")),
    ("tiny_dense_moe.mesh", "train"): R(pipeline="pipeline", batch=("data",), batch_shard=("data",), tensor=("tensor",), loss=("tensor",),
                                        expert=("data",)),
    # ZeRO 1 over replica x data (the experts' states over replica, the ranks holding the same ones);
    # ZeRO 2 over data only: HSDP, replicated over replica.
    ("tiny_qwen2_moe_experts_zero.mesh", "zero1"): R(batch=("replica", "data"), batch_shard=("replica", "data"),
                                                     expert=("data",)),
    ("tiny_qwen2_moe_experts_zero.mesh", "mixed"): R(batch=("replica", "data"), batch_shard=("data",),
                                                         expert=("data",)),
    ("llama3_8b_128k.mesh", "long_context"): R(batch_shard=("cp",), context=("cp",)),
    ("tiny_llama_context.mesh", "train"): R(batch_shard=("cp",), tensor=("tensor",), sequence=("tensor",), loss=("tensor",),
                                            context=("cp",)),
    ("mixtral_8x7b.mesh", "train"): R(batch=("data",), batch_shard=("data",), tensor=("tensor",), loss=("tensor",)),
    # experts over the in-host axis, ZeRO-3 over the hosts' (issue 38)
    ("gpt_oss_120b.mesh", "train"): R(batch=("data", "expert"), batch_shard=("data",), expert=("expert",)),
    # GLM-4.5: experts over the in-host axis, ZeRO 1 over both batch axes
    ("glm45_355b.mesh", "train"): R(pipeline="pipeline", batch=("data", "expert"), batch_shard=("data", "expert"),
                                    expert=("expert",)),
    # The zero-bubble V examples (issue 39); llama2_70b_zbv.mesh includes llama2_70b.mesh's plan too.
    ("llama2_70b_zbv.mesh", "train"): R(pipeline="pipeline", tensor=("tensor",), loss=("tensor",)),
    ("llama2_70b_zbv.mesh", "zbv_64"): R(pipeline="pipeline", tensor=("tensor",), sequence=("tensor",), loss=("tensor",)),
    ("tiny_llama_zbv.mesh", "train"): R(**DATA_PIPE_TP, batch_shard=("data",)),
}


def test_every_example_plan_has_the_roles_its_spec_says() -> None:
    got = {}
    for path in sorted(EXAMPLES.glob("*.mesh")):
        result = check_file(str(path))
        assert result.ok, path
        got.update({(path.name, name): plan.roles for name, plan in result.plans.items()})
    assert got == EXAMPLE_ROLES


def test_sizes_and_derived_roles_come_from_the_mesh() -> None:
    result = check_file(str(EXAMPLES / "llama2_70b_train.mesh"))
    plan = result.plans["train_64"]  # data = 4, pipeline = 2, tensor = 8; zero 3, seq -> tensor
    assert (plan.data_size, plan.pipeline_size, plan.zero_size, plan.sequence_size) == (4, 2, 4, 8)
    assert plan.roles.batch_replicate == () and plan.roles.zero_enabled
    assert plan.roles.sequence_parallel and plan.roles.loss_parallel
    plain = result.plans["train"]
    assert (plain.data_size, plain.zero_size, plain.sequence_size) == (1, 1, 1)
    assert not (plain.roles.zero_enabled or plain.roles.sequence_parallel)


def test_zero_0_over_the_batch_axes_shards_nothing() -> None:
    src = ("mesh m { axes data = 2, tensor = 2 }\n"
           "model t = llama { vocab = 256, hidden = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 128 }\n"
           "plan p on m for t {\n    layout { batch -> data }\n" + MEGATRON
           + "    optimizer adamw { zero 0 over data }\n}\n")
    result = check_text(src)
    assert result.ok, [d.message for d in result.errors]
    plan = result.plans["p"]
    roles = plan.roles
    assert roles.batch == ("data",) and roles.batch_shard == () and roles.batch_replicate == ("data",)
    # `meshc plan --json` names the axes ZeRO shards over: none at stage 0 (it printed the batch axes).
    report = report_json(analyze(plan, PROFILES["h100"]))
    assert (report["zero"], report["zero_axes"]) == (0, [])


def test_tensor_axes_are_in_mesh_order_whatever_order_the_rules_name_them() -> None:
    src = """
mesh m { axes a = 2, b = 2 }
model t = llama { vocab = 256, hidden = 64, layers = 2, heads = 4, kv_heads = 4, ffn = 128 }
plan p on m for t {
    layout { heads -> b * a, kv_heads -> b * a, ffn -> b * a, vocab -> b * a }
}
"""
    result = check_text(src)
    assert result.ok, [d.message for d in result.errors]
    roles = result.plans["p"].roles
    assert roles.tensor == ("a", "b") and roles.loss == ("a", "b")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(context=("t",), tensor=("t",)), "axes t are both context and tensor axes"),
    (dict(context=("d",), batch=("d",)), "axes d are both context and batch axes"),
    (dict(pipeline="p", context=("p",)), "axis `p` is both the pipeline and a context axis"),
    (dict(batch=("d",), expert=("ep",)), "expert axes ep are not batch, context or tensor axes"),
    (dict(tensor=("t",), sequence=("t",), expert=("t",)), "expert axes t are sequence-parallel"),
    (dict(pipeline="p", batch=("p",)), "axis `p` is both the pipeline and a batch axis"),
    (dict(pipeline="p", tensor=("p",)), "axis `p` is both the pipeline and a tensor axis"),
    (dict(batch=("d", "t"), tensor=("t",)), "axes t are both batch and tensor axes"),
    (dict(batch=("d",), batch_shard=("e",)), "batch_shard axes e are not batch or context axes"),
    (dict(tensor=("t",), sequence=("s",)), "sequence axes s are not tensor axes"),
    (dict(tensor=("t",), loss=("u",)), "loss axes u are not tensor axes"),
    (dict(batch=("d", "d")), "batch axes name d twice"),
])
def test_each_conflict_is_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message.replace('(', r'[(]').replace(')', r'[)]')}"):
        ParallelRoles(**kwargs)


def test_a_role_naming_an_axis_the_mesh_lacks_is_refused() -> None:
    mesh = MeshIR("m", (Axis("data", 2), Axis("tensor", 2)))
    ParallelRoles(batch=("data",), tensor=("tensor",)).validate(mesh)
    with pytest.raises(ValueError, match="^pipeline axes pipe are not axes of mesh `m`$"):
        ParallelRoles(pipeline="pipe").validate(mesh)


def test_a_plan_is_never_built_with_roles_that_disagree_with_it() -> None:
    plan = check_file(str(EXAMPLES / "tiny_llama.mesh")).plans["train"]
    with pytest.raises(ValueError, match="not axes of mesh"):
        attrs.evolve(plan, roles=attrs.evolve(plan.roles, batch=("nowhere",), batch_shard=()), zero=0)
    with pytest.raises(ValueError, match="ZeRO stage 1 with batch_shard axes"):
        attrs.evolve(plan, roles=attrs.evolve(plan.roles, batch_shard=()))
    # Equality and hashing still see the roles: two plans differing only in them differ.
    other = attrs.evolve(plan, roles=attrs.evolve(plan.roles, batch_shard=()), zero=0)
    assert other != plan and hash(other) != hash(plan)
