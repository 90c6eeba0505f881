"""Expert parallelism (`layout { experts -> D }`): each rank holds experts / |D| of every moe layer
and tokens travel to them by all-to-all. Sharded runs against the unsharded reference (outputs,
gradients, parameters after AdamW steps) on the shared pool of gloo ranks; the generated code;
the checker's refusals; the dispatcher itself in process against the single-rank experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from moe_specs import MODELS, TP, compile_spec, layout_lines, plan_spec  # noqa: E402
from reference_jobs import compare_job  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.compare import TOLERANCE  # noqa: E402

# tensor parallelism but for the experts' ffn: the experts over tensor take whole experts (etp = 1)
TP_ETP1 = TP.replace(" ffn -> tensor,", "")
PLANS = {  # mesh axes, layout, other lines
    # the dense layers replicated, data-parallel; the experts split over data
    "ep2": ("data = 2", "batch -> data, experts -> data", ""),
    # four ranks, one expert each
    "ep4": ("data = 4", "batch -> data, experts -> data", ""),
    # EP over a subset of the batch axes: expert grads still all-reduce over `replica`
    "replica2_ep2": ("replica = 2, data = 2", "batch -> replica * data, experts -> data", ""),
    # the same in rule style: `shard PATH expert(D)` places the moe layers' experts as `experts -> D`
    "replica2_ep2_rule": ("replica = 2, data = 2", "batch -> replica * data", "    shard blocks.*.mlp expert(data)\n"),
    # tensor parallelism inside the experts (their ffn) and in attention
    "ep2_tensor2": ("data = 2, tensor = 2", TP + ", batch -> data, experts -> data", ""),
    "pipeline2_ep2": ("pipeline = 2, data = 2", "batch -> data, experts -> data",
                      "    microbatches = 2\n    stages over pipeline balanced\n    schedule 1f1b\n"),
    # ZeRO 3 (FSDP2) of the dense parameters over data; each rank's experts are its own, whole
    "ep2_tensor2_zero3_recompute": ("data = 2, tensor = 2", TP + ", batch -> data, experts -> data",
                                    "    recompute = blocks\n    optimizer adamw { zero 3 }\n"),
    # HSDP: ZeRO 2 over data, replicated over replica; the experts replicated over replica too
    "replica2_ep2_zero2": ("replica = 2, data = 2", "batch -> replica * data, experts -> data",
                           "    optimizer adamw { zero 2 over data }\n"),
    # ZeRO 3 / 2 over replica x data: the dense parameters sharded over all four ranks, each layer's
    # experts over replica (the ranks holding the same experts), their gradients divided by all four
    "replica2_ep2_zero3": ("replica = 2, data = 2", "batch -> replica * data, experts -> data",
                           "    optimizer adamw { zero 3 }\n"),
    "replica2_ep2_zero2_all": ("replica = 2, data = 2", "batch -> replica * data, experts -> data",
                               "    optimizer adamw { zero 2 over replica * data }\n"),
    # ZeRO 1: the dense states sharded over replica x data, the experts' over replica (the ranks
    # holding the same experts), two ZeroRedundancyOptimizers stepped together
    "replica2_ep2_zero1": ("replica = 2, data = 2", "batch -> replica * data, experts -> data",
                           "    microbatches = 2\n    optimizer adamw { zero 1 }\n"),
    # EP over the context ranks' tokens too: the experts over data x context, or over context alone
    "context2_ep4": ("data = 2, context = 2", "batch -> data, seq -> context, experts -> data * context", ""),
    "context2_ep_context2": ("data = 2, context = 2", "batch -> data, seq -> context, experts -> context", ""),
    # ZeRO 3 over data x context: experts over context are a unit of their own over data
    "context2_ep_context2_zero3": ("data = 2, context = 2", "batch -> data, seq -> context, experts -> context",
                                   "    optimizer adamw { zero 3 }\n"),
    # EP over a tensor axis (torchtitan's EP over dp_shard x tp, etp = 1): each tensor rank routes half
    # the tokens to whole experts and the outputs are all-gathered; the shared expert's ffn over tensor
    "ep4_over_tensor": ("data = 2, tensor = 2", TP_ETP1 + ", batch -> data, experts -> data * tensor", ""),
    "ep_tensor2": ("tensor = 2", TP_ETP1 + ", experts -> tensor", ""),
    "data2_ep_tensor2": ("data = 2, tensor = 2", TP_ETP1 + ", batch -> data, experts -> tensor", ""),
    "pipeline2_ep_tensor2": ("pipeline = 2, tensor = 2", TP_ETP1 + ", experts -> tensor",
                             "    microbatches = 2\n    stages over pipeline balanced\n    schedule 1f1b\n"),
    # FSDP2 over data beside experts over data x tensor (each rank's own: plain tensors)
    "ep4_over_tensor_zero3": ("data = 2, tensor = 2", TP_ETP1 + ", batch -> data, experts -> data * tensor",
                              "    optimizer adamw { zero 3 }\n"),
    # ZeRO 1 over data: the experts' states whole on their own rank, the dense ones sharded over data
    "ep4_over_tensor_zero1": ("data = 2, tensor = 2", TP_ETP1 + ", batch -> data, experts -> data * tensor",
                              "    microbatches = 2\n    optimizer adamw { zero 1 }\n"),
    # ZeRO 2 over data with the experts over tensor only: FSDP2 shards them over data with the block
    "ep_tensor2_zero2": ("data = 2, tensor = 2", TP_ETP1 + ", batch -> data, experts -> tensor",
                         "    optimizer adamw { zero 2 }\n"),
    # Megatron's distributed optimizer (FSDP2, gradients reduced once a step) with `precision`: the
    # experts, left out of FSDP2, cast to the compute dtype like the dense weights
    "ep2_zero1_precision": ("data = 2", "batch -> data, experts -> data",
                            "    microbatches = 2\n    precision { params = bf16, master = fp32 }\n"
                            "    optimizer adamw { zero 1 }\n"),
}


def ep_spec(model: str, plan: str) -> str:
    axes, layout, rest = PLANS[plan]
    return plan_spec(axes, MODELS[model], layout_lines(model, layout, replicate_routers="tensor" in layout) + rest,
                     batch=8)


def compiled(model: str, plan: str, tmp_path: Path) -> tuple[str, int, str]:
    return compile_spec(ep_spec(model, plan), f"{model}_{plan}", tmp_path)


CASES = [("mixtral", "ep2"), ("qwen3_moe", "ep4"), ("qwen2_moe", "replica2_ep2_rule"), ("mixtral", "ep2_tensor2"),
         ("qwen2_moe", "ep2_tensor2"), ("mixtral", "pipeline2_ep2"), ("qwen3_moe", "ep2_tensor2_zero3_recompute"),
         ("mixtral", "replica2_ep2_zero2"), ("qwen2_moe", "replica2_ep2_zero1"), ("mixtral", "ep2_zero1_precision"),
         ("mixtral", "replica2_ep2_zero3"), ("qwen2_moe", "replica2_ep2_zero2_all"), ("mixtral", "context2_ep4"),
         ("qwen2_moe", "context2_ep_context2"), ("mixtral", "context2_ep_context2_zero3"),
         ("mixtral", "ep4_over_tensor"), ("qwen2_moe", "data2_ep_tensor2"), ("qwen3_moe", "ep_tensor2"),
         ("mixtral", "pipeline2_ep_tensor2"), ("qwen3_moe", "ep4_over_tensor_zero3"), ("qwen2_moe", "ep_tensor2_zero2"),
         ("mixtral", "ep4_over_tensor_zero1")]


@pytest.mark.parametrize(("model", "plan"), CASES)
def test_expert_parallel_moe_equals_the_reference(model: str, plan: str, pool: Any, tmp_path: Path) -> None:
    path, n, _ = compiled(model, plan, tmp_path)
    for rank_errs in pool.run(compare_job, n, path, 2):
        for dtype, errs in rank_errs.items():
            worst = max(errs, key=errs.__getitem__)
            assert errs[worst] <= TOLERANCE[dtype], (dtype, worst, errs[worst])


def _checked(text: str):  # type: ignore[no-untyped-def]
    return check_text(text, "ep.mesh")


def _codes(text: str) -> set[str]:
    return {d.code for d in _checked(text).errors}


def test_each_rank_builds_and_holds_only_its_experts(tmp_path: Path) -> None:
    _, _, code = compiled("qwen2_moe", "replica2_ep2", tmp_path)
    # 3 of 6 experts per rank, every ffn; the spec says the experts dim is split over data
    assert "self.mlp.gate = rt.StackedLinear(3, 32, 24)  # experts over data: [24, 3 experts, 32]" in code
    assert "rt.ShardSpec(prefix + 'mlp.down.weight', (32, 6, 24), ((1, ('data',)),))" in code
    assert "self.mlp = rt.ExpertsParallel()  # its experts split over ranks" in code
    assert code.count("out = self.mlp.experts(t, chosen, weights, self.g_data)") == 1
    assert "rt.moe_experts(" not in code
    _, _, code = compiled("qwen2_moe", "ep2_tensor2", tmp_path)
    # tensor inside the experts: the ffn over tensor, the experts over data, in that order
    assert "rt.ShardSpec(prefix + 'mlp.gate.weight', (24, 6, 32), ((0, ('tensor',)), (1, ('data',))))" in code
    assert "self.mlp.gate = rt.StackedLinear(3, 32, 12)  # column(tensor), experts over data" in code
    assert "out = self.mlp.experts(xt, chosen, weights," in code


def test_the_plan_records_expert_parallelism_and_the_local_experts() -> None:
    (plan,) = _checked(ep_spec("mixtral", "replica2_ep2")).plans.values()
    assert plan.roles.expert == ("data",) and plan.roles.tensor == ()  # data stays a batch axis, no tensor axis
    gate = plan.placement("blocks.0.mlp.gate")
    (t,) = next(lf for _, _, lf in plan.model.leaves() if lf.name == "gate").params
    assert plan.local_shape(t, gate) == (48, 2, 32)
    assert str(gate.layout(t)) == "Shard(experts) over data"
    assert not plan.placement("blocks.0.mlp.router").sharded


@pytest.mark.parametrize(("layout", "rest", "code"), [
    ("batch -> data, experts -> tensor", "", "E0412"),  # tensor ranks hold the same tokens
    ("experts -> data", "", "E0412"),  # no data parallelism: the tokens are the same everywhere
    ("batch -> data, experts -> data, ffn -> data", "", "E0407"),  # one axis, two roles in one tensor
])
def test_expert_parallelism_that_does_not_fit_is_refused(layout: str, rest: str, code: str) -> None:
    text = (f"mesh m {{ axes data = 2, tensor = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = 8\n"
            f"    layout {{ {layout} }}\n{rest}}}\n")
    assert code in _codes(text)


@pytest.mark.parametrize(("experts", "rule"), [("data * context", ""), ("context", ""),
                                               ("", "    shard blocks.*.mlp expert(data, context)\n")])
def test_experts_over_context_axes_leave_them_context_axes(experts: str, rule: str) -> None:
    """The experts' placement splits no weight dim: `seq -> context` stays context parallelism
    (not Megatron sequence parallelism, which an axis splitting weights would make it)."""
    layout = "batch -> data, seq -> context" + (f", experts -> {experts}" if experts else "")
    text = (f"mesh m {{ axes data = 2, context = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = 8\n"
            f"    seq = 8\n    layout {{ {layout} }}\n{rule}}}\n")
    (plan,) = _checked(text).plans.values()
    assert plan.roles.context == ("context",) and plan.roles.sequence == ()
    assert plan.roles.expert == (tuple(experts.split(" * ")) if experts else ("data", "context"))


def test_experts_over_a_sequence_parallel_axis_are_refused() -> None:
    """`seq -> tensor` beside `heads -> tensor` is sequence parallelism: tensor ranks hold the same
    tokens outside the norm regions, so the experts cannot split over it."""
    text = (f"mesh m {{ axes data = 2, tensor = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = 8\n"
            "    seq = 8\n    layout { batch -> data, seq -> tensor, heads -> tensor, experts -> data * tensor }\n}\n")
    d = next(d for d in _checked(text).errors if d.code == "E0412")
    assert d.message == ("expert parallelism over tensor, which sequence parallelism splits the tokens over "
                         "(tensor): the moe layers take whole sequences")
    assert "`experts -> data`" in d.help


def _errors(layout: str, batch: int = 8, seq: int = 8) -> list[tuple[str, str, str]]:
    text = (f"mesh m {{ axes data = 2, tensor = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = {batch}\n"
            f"    seq = {seq}\n    layout {{ {layout}, vocab -> tensor, kv_heads -> tensor }}\n"
            "    shard blocks.*.mlp.router replicate\n}\n")
    return [(d.code, d.message, text[d.span.start:d.span.end]) for d in _checked(text).errors]


def test_experts_over_a_tensor_axis_keep_each_expert_whole() -> None:
    """torchtitan's etp = 1: each tensor rank routes its share of the tokens to whole experts, so
    the experts' ffn may not split over tensor too (ETP with the experts over batch axes does)."""
    assert _errors("batch -> data, heads -> tensor, experts -> data * tensor") == []
    assert _errors("batch -> data, heads -> tensor, ffn -> tensor, experts -> data") == []
    assert _errors("batch -> data, heads -> tensor, ffn -> tensor, experts -> data * tensor") == [
        ("E0412", "the experts are split over tensor, a tensor axis, and their ffn over tensor too", "ffn -> tensor")]


def test_tokens_that_do_not_split_over_the_experts_tensor_axis_are_refused() -> None:
    """batch 2 over data 2 at seq 3: 3 tokens per rank, which the two tensor ranks cannot share."""
    assert _errors("batch -> data, heads -> tensor, experts -> data * tensor", batch=2, seq=3) == [
        ("E0412", "3 tokens per microbatch on a rank do not split over tensor (2)", "experts -> data * tensor")]


@pytest.mark.parametrize(("model", "plan"), [("qwen2_moe", "replica2_ep2"), ("mixtral", "ep2_tensor2"),
                                             ("mixtral", "pipeline2_ep2")])
def test_the_expert_rule_compiles_to_what_the_layout_entry_does(model: str, plan: str) -> None:
    layout = ep_spec(model, plan)
    rule = layout.replace(", experts -> data", "").replace("    seq = 8\n", "    seq = 8\n    shard blocks.*.mlp expert(data)\n")
    assert "expert(data)" in rule and "experts ->" not in rule
    (a,), (b,) = _checked(layout).plans.values(), _checked(rule).plans.values()
    assert render_plan(a, "ep.mesh", layout) == render_plan(b, "ep.mesh", layout)
    from meshllm_dsl.front.fmt import format_text

    assert format_text(format_text(rule)) == format_text(rule) and "shard blocks.*.mlp expert(data)" in format_text(rule)


@pytest.mark.parametrize(("rule", "layout", "code", "caret"), [
    ("shard blocks.*.attn expert(data)", "batch -> data", "E0405", "expert(data)"),  # no experts there
    ("shard blocks.*.mlp.router expert(data)", "batch -> data", "E0405", "expert(data)"),  # the router stays whole
    ("shard blocks.*.mlp expert(tensor)", "batch -> data", "E0412", "expert(tensor)"),  # not a batch axis
    ("shard blocks.*.mlp expert(data)", "batch -> data, experts -> data", "E0412", "expert(data)"),  # twice
    ("shard blocks.1.mlp expert(data)", "batch -> data", "E0309", "blocks.1.mlp"),  # one layer only: not yet
    ("shard blocks.*.mlp expert", "batch -> data", "E0406", "expert"),  # no axes
    ("shard blocks.*.mpl expert(data)", "batch -> data", "E0502", "blocks.*.mpl"),  # a typo
])
def test_the_expert_rule_that_does_not_fit_is_refused_located(rule: str, layout: str, code: str, caret: str) -> None:
    text = (f"mesh m {{ axes data = 2, tensor = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = 8\n"
            f"    layout {{ {layout} }}\n    {rule}\n}}\n")
    (d,) = _checked(text).errors
    assert d.code == code and d.help, d.message
    assert text[d.span.start:d.span.end] == caret


@pytest.mark.parametrize("rest", [
    "    optimizer adamw { zero 1 }\n",  # ZeroRedundancyOptimizer: the experts' states over tensor
    "    precision { params = bf16, master = fp32 }\n",
    "    precision { params = bf16, master = fp32 }\n    optimizer adamw { zero 1 over data }\n",
    "    precision { params = bf16 }\n    optimizer adamw { zero 3 over data }\n",
])
def test_zero_and_precision_compose_with_expert_parallelism(rest: str) -> None:
    text = (f"mesh m {{ axes data = 2, tensor = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = 8\n"
            f"    layout {{ batch -> data * tensor, experts -> data }}\n{rest}}}\n")
    assert not _codes(text)


def test_zero_over_some_axes_replicating_the_experts_says_what_would_work() -> None:
    text = (f"mesh m {{ axes a = 2, b = 2, data = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = 8\n"
            "    layout { batch -> a * b * data, experts -> data }\n    optimizer adamw { zero 2 over b * data }\n}\n")
    (d,) = _checked(text).errors
    assert d.message == "ZeRO 2 over b, which replicates the experts, while a replicates them too, is not supported yet"
    assert "`zero 2 over a * b * data`" in d.help and "`zero 2 over data`" in d.help
    assert "`zero 1` without `precision`" in d.help


def test_zero_over_every_axis_replicating_the_experts_is_accepted() -> None:
    for rest in ("optimizer adamw { zero 2 }", "optimizer adamw { zero 3 over data * tensor }",
                 "precision { params = bf16, master = fp32 }\n    optimizer adamw { zero 1 }"):
        text = (f"mesh m {{ axes data = 2, tensor = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = 8\n"
                f"    layout {{ batch -> data * tensor, experts -> data }}\n    {rest}\n}}\n")
        assert not _codes(text), rest


STEPS = 3


def _bf16_job(ctx: Any, path: str) -> dict[str, Any]:
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.runtime.train.program import optimizer_parts
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    losses = [built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 3, s))
              for s in range(STEPS)]
    experts = [q for n, q in built.modules[0].named_parameters() if n.endswith(("mlp.gate.weight", "mlp.down.weight"))]
    experts_ids = {id(q) for q in experts}
    moments = {str(v.dtype) for inner in optimizer_parts(built.optimizer) for q, st in inner.state.items()
               if id(q) in experts_ids for k, v in st.items() if k != "step"}
    return {"losses": losses, "experts": {str(q.dtype) for q in experts},
            "grads": {str(q.grad.dtype) for q in experts if q.grad is not None}, "moments": moments}


@pytest.mark.parametrize("zero", ["", "    optimizer adamw { zero 1 }\n", "    optimizer adamw { zero 2 }\n"])
def test_precision_treats_the_experts_as_the_dense_weights(zero: str, pool: Any, tmp_path: Path) -> None:
    """`precision { params = bf16, master = fp32 }` with expert parallelism, in bf16 as a plan trains
    (the exact comparison above runs every dtype equal): the experts' master weights, gradients and
    moments stay fp32 and they compute in bf16 as the dense weights do, so the run tracks the same plan
    without expert parallelism: its first loss equal, the next within bf16 rounding of the updates."""
    rest = "    precision { params = bf16, master = fp32 }\n" + zero
    runs = {}
    for name, layout in (("ep", "batch -> data, experts -> data"), ("dp", "batch -> data")):
        text = (f"mesh m {{ axes data = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = 8\n    seq = 8\n"
                f"    layout {{ {layout} }}\n{rest}}}\n")
        result = check_text(text, f"{name}.mesh")
        assert result.ok, [d.message for d in result.errors]
        (plan,) = result.plans.values()
        path = tmp_path / f"{name}.py"
        path.write_text(render_plan(plan, f"{name}.mesh", text))
        runs[name] = pool.run(_bf16_job, 2, str(path))[0]
    ep, dp = runs["ep"], runs["dp"]
    assert ep["experts"] == ep["grads"] == ep["moments"] == {"torch.float32"}, ep
    assert ep["losses"][0] == pytest.approx(dp["losses"][0], abs=1e-6)
    assert ep["losses"] == pytest.approx(dp["losses"], abs=1e-3)


def _replica_bytes_job(ctx: Any, path: str) -> int:
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.runtime.train.profile import CollectiveLog
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    log = CollectiveLog(built.mesh)
    with log:
        built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 3, 0))
    return int(log.stats[("replica", "all_reduce")][1])


def test_hsdp_reduces_the_experts_over_their_replicas_in_the_reduce_dtype(pool: Any, tmp_path: Path) -> None:
    """ZeRO 2 over data with `precision` (gradients reduced in bf16): FSDP2's HSDP all-reduces the
    dense shards across replica, the runtime the experts it leaves out, in bf16 too; the bytes the
    ranks send over replica are those `meshc plan` counts."""
    text = (f"mesh m {{ axes replica = 2, data = 2 }}\n{MODELS['mixtral']}\nplan p on m for m {{\n    batch = 8\n"
            "    seq = 8\n    layout { batch -> replica * data, experts -> data }\n"
            "    precision { params = bf16, master = fp32 }\n    optimizer adamw { zero 2 over data }\n}\n")
    (plan,) = _checked(text).plans.values()
    path = tmp_path / "hsdp.py"
    path.write_text(render_plan(plan, "hsdp.mesh", text))
    from meshllm_dsl.planner import analyze as planner

    planned = [c for c in planner.analyze(plan).ranks[0].comms if c.axis == "replica" and c.op == "all_reduce"]
    experts = 2 * 3 * 2 * 48 * 32  # layers x (gate, up, down) x local experts x ffn x hidden
    assert [c.payload_bytes for c in planned if c.calls == 1] == [2 * experts]  # bf16
    for got in pool.run(_replica_bytes_job, 4, str(path)):
        assert got == sum(c.payload_bytes for c in planned)


def _resume_job(ctx: Any, path: str, root: str, save_at: int | None, load: bool) -> tuple[list[float], Any]:
    """Build (from another seed when loading: the load must replace the weights), optionally resume
    from ``root``, train to step 4 (saving at ``save_at``); the losses and the final weights."""
    from meshllm_dsl.runtime.train import checkpoint
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=5 if load else 0)
    start = checkpoint.load(built, root, optimizer=True)["state"]["step"] if load else 0
    losses = []
    for step in range(start, 4 if save_at is None else save_at):
        losses.append(built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 3, step)))
    if save_at is not None:
        checkpoint.save(built, root, step=save_at, state={"step": save_at})
    return losses, built.full_state_dict()


@pytest.mark.parametrize(("model", "plan"), [("qwen2_moe", "replica2_ep2_zero1"), ("mixtral", "ep2_zero1_precision"),
                                            ("mixtral", "replica2_ep2_zero3")])
def test_zero1_with_experts_resumes_bit_for_bit(model: str, plan: str, pool: Any, tmp_path: Path) -> None:
    """The two ZeRO partitions (dense over replica x data, experts over replica), or FSDP2's sharded
    states beside the experts' whole ones, or the experts' own FSDP2 units over replica (ZeRO 3),
    through a checkpoint: a resumed run continues exactly."""
    path, n, _ = compiled(model, plan, tmp_path)
    root = str(tmp_path / "ckpt")
    losses, final = pool.run(_resume_job, n, path, root, None, False)[0]
    first, _ = pool.run(_resume_job, n, path, root, 2, False)[0]
    second, resumed = pool.run(_resume_job, n, path, root, None, True)[0]
    assert first + second == losses
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name


def test_experts_that_do_not_divide_over_the_axis_are_refused() -> None:
    text = ep_spec("qwen2_moe", "ep4")  # 6 experts over 4 ranks
    diags = _checked(text).errors
    assert [d.code for d in diags] == ["E0301"] and "`experts` (6) is not divisible by data (4)" in diags[0].message


def test_a_model_without_experts_has_nothing_to_split() -> None:
    text = ("mesh m { axes data = 2 }\nmodel t = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, ffn = 64 }\n"
            "plan p on m for t {\n    layout { batch -> data, experts -> data }\n}\n")
    assert "E0502" in _codes(text)


def test_the_planner_counts_local_experts_and_the_all_to_alls() -> None:
    from meshllm_dsl.planner import analyze as planner

    (ep,) = _checked(ep_spec("mixtral", "ep2")).plans.values()
    (dp,) = _checked(ep_spec("mixtral", "ep2").replace(", experts -> data", "")).plans.values()
    rep_ep, rep_dp = planner.analyze(ep), planner.analyze(dp)
    h, f, e, layers = 32, 48, 4, 2
    # each rank holds 2 of the 4 experts of each layer
    assert rep_dp.ranks[0].params_local - rep_ep.ranks[0].params_local == layers * 3 * (e // 2) * f * h
    a2a = [c for c in rep_ep.ranks[0].comms if c.kind == "expert"]
    tokens = 8 // 2 * 8  # this rank's batch x seq
    (c,) = a2a
    assert (c.op, c.axis, c.calls) == ("all_to_all", "data", layers * 4)  # dispatch + combine, fwd + bwd
    assert c.payload_bytes == layers * 4 * tokens * 2 * h * 4  # top_k rows of hidden fp32 per token
    assert c.wire_bytes == c.payload_bytes // 2  # half the rows stay on this rank (of 2)
    assert not [c for c in rep_dp.ranks[0].comms if c.kind == "expert"]
    # the experts' gradients are not all-reduced over data: only the dense parameters are
    (red_ep,) = [c for c in rep_ep.ranks[0].comms if c.kind == "data"]
    (red_dp,) = [c for c in rep_dp.ranks[0].comms if c.kind == "data"]
    assert red_dp.payload_bytes - red_ep.payload_bytes == 4 * layers * 3 * e * f * h
    assert rep_ep.step.expert_s == c.seconds > 0
    per = planner.expert_layer_comm(rep_ep)
    assert per is not None and per["payload_bytes"] == tokens * 2 * h * 4 and per["calls_per_step"] == 4


def _a2a_bytes_job(ctx: Any, path: str) -> tuple[list[int], dict[tuple[str, str], list[float]]]:
    """One training step: the bytes each forward all-to-all of the dispatcher hands over (dispatch,
    combine, per moe layer) and CollectiveLog's (calls, bytes) per (axes, op) on this rank."""
    from meshllm_dsl.runtime.moe import dispatch
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.runtime.train.profile import CollectiveLog
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    sent: list[int] = []
    original = dispatch._all_to_all

    def counting(x: Any, out_splits: list[int], in_splits: list[int], group: Any) -> Any:
        sent.append(x.numel() * x.element_size())
        return original(x, out_splits, in_splits, group)

    dispatch._all_to_all = counting  # type: ignore[assignment]
    log = CollectiveLog(built.mesh)
    try:
        with log:
            built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 3, 0))
    finally:
        dispatch._all_to_all = original  # type: ignore[assignment]
    return sent, {k: v[:2] for k, v in log.stats.items()}


@pytest.mark.parametrize(("model", "plan"), [("mixtral", "ep4_over_tensor"), ("mixtral", "context2_ep4"),
                                             ("mixtral", "ep2")])
def test_the_planner_counts_the_all_to_all_bytes_the_dispatcher_sends(model: str, plan: str, pool: Any,
                                                                      tmp_path: Path) -> None:
    """Exact: each rank's dispatch hands over its top_k rows per token (of its 1 / |tensor| share
    over a tensor axis), as `meshc plan` counts per call; the combines, uneven per rank, sum over
    the ranks to as much. Over a tensor axis the routed outputs, the tokens' and the routing weights'
    gradients are all-gathered over it: the planner's tensor all-gathers, byte for byte."""
    from meshllm_dsl.planner import analyze as planner

    path, n, _ = compiled(model, plan, tmp_path)
    (checked,) = _checked(ep_spec(model, plan)).plans.values()
    comms = planner.analyze(checked).ranks[0].comms
    (a2a,) = [c for c in comms if c.kind == "expert"]
    per_call = a2a.payload_bytes // a2a.calls
    layers = 2
    runs = pool.run(_a2a_bytes_job, n, path)
    for sent, _ in runs:
        assert sent[0::2] == [per_call] * layers  # dispatch, each layer
    assert sum(sum(sent[1::2]) for sent, _ in runs) == n * layers * per_call  # combine
    gathers = [c for c in comms if c.kind == "tensor" and c.op == "all_gather"]
    # every all-gather over tensor a rank runs: the moe layers' and the vocab-parallel loss's
    planned = [sum(c.calls for c in comms if c.axis == "tensor" and c.op == "all_gather"),
               sum(c.payload_bytes for c in comms if c.axis == "tensor" and c.op == "all_gather")]
    assert all(stats.get(("tensor", "all_gather"), [0, 0]) == planned for _, stats in runs), planned
    # the outputs', the tokens' and the routing weights' gradients, each layer
    assert sum(c.calls for c in gathers) == (3 * layers if checked.roles.expert_token_split else 0)


def test_weights_read_per_rank_experts_and_export_gathers_them(pool: Any, tmp_path: Path) -> None:
    """`--weights` under expert parallelism x tensor (runtime/hf_moe.local_stacked reads a rank's
    experts only) gives transformers' logits and greedy tokens; `--export-hf` gathers every
    expert back into the hub's per-expert tensors, which transformers loads unchanged."""
    from hf_models import export_job, logits_job
    from test_moe_hf import N_NEW, build_moe

    directory = tmp_path / "hf"
    hf = build_moe("mixtral", directory)
    tokens = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(tokens).logits
        want_tokens = hf.generate(tokens[:1], max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW)
    path, n, _ = compiled("mixtral", "ep2_tensor2", tmp_path)
    logits, generated = pool.run(logits_job, n, path, str(directory), tokens, N_NEW)[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert generated.tolist() == want_tokens.tolist()
    out = tmp_path / "export"
    pool.run(export_job, n, path, str(directory), str(out), 5 * 10**9)
    back = type(hf).from_pretrained(out).eval()
    with torch.no_grad():
        assert (back(tokens).logits - want).abs().max().item() == 0.0


def _dispatch_paths_job(ctx: Any) -> dict[str, float]:
    """On each of 2 ranks: expert-parallel experts (4 experts, 2 a rank) through the grouped
    projections and through the loop (grouped_runs made to say no): outputs and every gradient."""
    from meshllm_dsl.runtime.moe import dispatch

    mesh = ctx.mesh((("data", 2),))
    group = mesh.group("data")
    gen = torch.Generator().manual_seed(11)  # the same weights on both ranks, then each its own half
    hid, ffn, experts, k = 32, 16, 4, 2
    full = {n: torch.randn(shape, generator=gen) * 0.3 for n, shape in
            (("gate", (ffn, experts, hid)), ("up", (ffn, experts, hid)), ("down", (hid, experts, ffn)))}
    local = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    tok = torch.Generator().manual_seed(100 + ctx.rank)
    x = torch.randn(24, hid, generator=tok)
    idx = torch.stack([torch.randperm(experts, generator=tok)[:k] for _ in range(24)])
    weights = torch.rand(24, k, generator=tok)
    out: dict[str, Any] = {}
    calls = []
    real = dispatch.grouped_experts_ffn

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    for path in ("grouped", "loop"):
        leaves = {n: (w[:, local] if n != "down" else w[:, local]).clone().requires_grad_(True) for n, w in full.items()}
        xs, ws = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        dispatch.grouped_experts_ffn = counted
        saved = dispatch.grouped_runs
        if path == "loop":
            dispatch.grouped_runs = lambda *a: False  # type: ignore[assignment]
        try:
            y = dispatch.experts_parallel(xs, idx, ws, leaves["gate"], leaves["up"], leaves["down"], group)
        finally:
            dispatch.grouped_runs, dispatch.grouped_experts_ffn = saved, real
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        out[path] = (y.detach(), xs.grad, ws.grad, *(leaves[n].grad for n in ("gate", "up", "down")))
    diffs = [float((a - b).abs().max()) for a, b in zip(out["grouped"], out["loop"])]
    return {"grouped_calls": float(len(calls)), "max_diff": max(diffs)}


def test_the_dispatcher_runs_its_experts_grouped_and_equals_the_loop(pool: Any) -> None:
    for got in pool.run(_dispatch_paths_job, 2):
        assert got["grouped_calls"] == 1  # the grouped path ran once (float32, aligned); the loop run none
        assert got["max_diff"] <= 1e-5, got
