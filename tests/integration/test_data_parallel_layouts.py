"""HSDP, the distributed optimizer and recomputation granularity (issue 23) on gloo ranks vs the
unsharded reference: each plan is compiled by meshc, trained for 3 AdamW steps on the shared pool
and compared (logits, step-0 gradients, every loss, every parameter afterwards)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from mesh_snippets import MEGATRON  # noqa: E402
from reference_jobs import compare_job  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.compare import TOLERANCE  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402

LLAMA = "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }"


def _spec(axes: str, body: str) -> str:
    return f"mesh m {{ axes {axes} }}\n{LLAMA}\nplan p on m for m {{\n    batch = 8\n    seq = 8\n{body}\n}}\n"


HSDP = "layout { batch -> replica * data }\n"
# Master weights at ZeRO 0: bf16 products under autocast, fp32 master weights (the parameters), fp32
# gradients, reduction and moments (runtime/train/amp.py); at ZeRO 1 the distributed optimizer (FSDP2 with
# the master weights sharded). Compared in fp32 / fp64, where every dtype is the same; the bf16 run
# itself is checked below.
PRECISION = "precision { params = bf16, master = fp32 }\n"
CASES: dict[str, str] = {
    # HSDP: FSDP2 over a 2-D (replicate, shard) mesh; sharded over `data`, replicated over `replica`.
    "hsdp_zero3": _spec("replica = 2, data = 2", HSDP + "optimizer adamw { zero 3 over data\n clip = 0.01 }"),
    # The shard axis first in mesh order, the replica axis last; with tensor parallelism inside.
    "hsdp_zero2_shard_first_tensor2": _spec(
        "data = 2, replica = 2, tensor = 2", MEGATRON + "microbatches = 2\n" + HSDP + "optimizer adamw { zero 2 over data }"),
    # ZeRO-1 over a subset: ZeroRedundancyOptimizer over the shard group, replicas step alike.
    "hsdp_zero1": _spec("replica = 2, data = 2", HSDP + "optimizer adamw { zero 1 over data }"),
    # Selective op recomputation: the tensor-parallel collectives rerun inside the recomputed block.
    "recompute_ops_tensor2": _spec("tensor = 2", MEGATRON + "recompute = ops"),
    "recompute_ops_pipeline2_tensor2_1f1b": _spec(
        "pipeline = 2, tensor = 2", MEGATRON + "microbatches = 2\n recompute = ops\n stages over pipeline balanced\n schedule 1f1b"),
    "recompute_ops_sequence_parallel": _spec(
        "tensor = 2", MEGATRON + "recompute = ops\n layout { seq -> tensor }"),
    # Every 2nd block (1 and 3): one recomputed, one not on each pipeline stage.
    "recompute_blocks_every2_pipeline2_tensor2": _spec(
        "pipeline = 2, tensor = 2", MEGATRON + "microbatches = 2\n recompute = blocks every 2\n stages over pipeline balanced"),
    "recompute_ops_every3_data2_zero3": _spec(
        "data = 2", "microbatches = 2\n recompute = ops every 3\n layout { batch -> data }\n optimizer adamw { zero 3 }"),
    # ZeRO 1 with master weights is Megatron's distributed optimizer (FSDP2, runtime/parallel/fsdp.py): with
    # microbatches the gradients are accumulated whole and reduce-scattered once, at the last.
    "precision_zero1_data2_tensor2": _spec(
        "data = 2, tensor = 2", MEGATRON + "microbatches = 2\n layout { batch -> data }\n" + PRECISION
        + "optimizer adamw { zero 1\n clip = 0.01 }"),
    "precision_zero1_hsdp_pipeline2_1f1b": _spec(
        "replica = 2, data = 2, pipeline = 2", "microbatches = 2\n" + HSDP + " stages over pipeline balanced\n"
        " schedule 1f1b\n" + PRECISION + "optimizer adamw { zero 1 over data }"),
    "precision_zero0_pipeline2_data2_1f1b": _spec(
        "data = 2, pipeline = 2", "microbatches = 2\n layout { batch -> data }\n stages over pipeline balanced\n"
        " schedule 1f1b\n" + PRECISION),
}


def _run(name: str, text: str, pool: WorkerPool, tmp_path: Path) -> None:
    result = check_text(text, f"{name}.mesh")
    assert result.ok, [str(d.message) for d in result.errors]
    (plan,) = result.plans.values()
    path = tmp_path / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", text))
    per_rank = pool.run(compare_job, plan.mesh.devices, str(path))
    for rank, errs in enumerate(per_rank):
        for dtype, by_key in errs.items():
            bad = {k: v for k, v in by_key.items() if not v <= TOLERANCE[dtype]}
            assert not bad, f"rank {rank}, {dtype}: {bad}"


@pytest.mark.parametrize("name", list(CASES))
def test_plan_matches_unsharded_reference(name: str, pool: WorkerPool, tmp_path: Path) -> None:
    _run(name, CASES[name], pool, tmp_path)


def _hsdp_layout_job(ctx, path: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    (module,) = built.modules.values()
    param = module.get_parameter("embed.weight")
    return {"mesh": param.device_mesh.mesh.tolist(), "names": param.device_mesh.mesh_dim_names,
            "placements": [str(p) for p in param.placements], "local_rows": param.to_local().shape[0],
            "rows": param.shape[0]}


def test_hsdp_shards_over_the_zero_axes_and_replicates_over_the_rest(pool: WorkerPool, tmp_path: Path) -> None:
    # The shard axis (`data`) first in mesh order: replicas are 1 rank apart, shards 2.
    text = _spec("data = 2, replica = 2", HSDP + "optimizer adamw { zero 3 over data }")
    result = check_text(text, "hsdp.mesh")
    (plan,) = result.plans.values()
    path = tmp_path / "hsdp.py"
    path.write_text(render_plan(plan, "hsdp.mesh", text))
    got = pool.run(_hsdp_layout_job, 4, str(path))
    assert got[0] == {"mesh": [[0, 2], [1, 3]], "names": ("replica", "data"), "placements": ["R", "S(0)"],
                      "local_rows": 32, "rows": 64}
    assert [g["mesh"] for g in got] == [[[0, 2], [1, 3]]] * 4


def _master_job(ctx, path: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    from meshllm_dsl.runtime.parallel.fsdp import data_local
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    # ZeRO 1 with master weights: FSDP2's DTensors, this rank's shard of each.
    params = [data_local(p) for p in built.parameters()]
    before = [p.detach().clone() for p in params]
    losses = [built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 7, s)) for s in range(2)]
    inner = getattr(built.optimizer, "optim", built.optimizer)  # ZeRO-1: its local AdamW
    states = [v for st in inner.state.values() for k, v in st.items() if k != "step"]
    moved = sum(int((p.detach() != b).sum()) for p, b in zip(params, before))
    grads = [p.grad for p in built.parameters() if p.grad is not None]  # (FSDP2 swaps in gathered ones to run)
    out = built.run_stages(torch.zeros(2, 8, dtype=torch.long))
    return {"param": {str(p.dtype) for p in params}, "grad": {str(g.dtype) for g in grads},
            "optim": {str(v.dtype) for v in states}, "logits": None if out is None else str(out.dtype),
            "losses": losses, "moved": moved / sum(p.numel() for p in params)}


@pytest.mark.parametrize("zero", [0, 1])
def test_master_weights_at_zero_0_and_1_keep_updates_bf16_would_round_away(zero: int, pool: WorkerPool,
                                                                           tmp_path: Path) -> None:
    # lr 1e-5 moves each weight by about 1e-5, under half a bf16 ulp of most of them: in bf16
    # (`dtype = bf16`) the step leaves them as they were, with fp32 master weights it does not.
    moved = {}
    for name, body in (("master", PRECISION), ("bf16", "dtype = bf16\n")):
        text = _spec("data = 2", f"layout {{ batch -> data }}\n{body} optimizer adamw {{ zero {zero}\n lr = 1e-5 }}")
        (plan,) = check_text(text, f"{name}.mesh").plans.values()
        path = tmp_path / f"{name}.py"
        path.write_text(render_plan(plan, f"{name}.mesh", text))
        got = pool.run(_master_job, 2, str(path))[0]
        moved[name] = got["moved"]
        if name == "master":
            assert got["param"] == got["grad"] == got["optim"] == {"torch.float32"}, got
            assert got["logits"] == "torch.bfloat16", got  # the head's product ran in bf16
    assert moved["master"] > 0.9 and moved["bf16"] < 0.5, moved


def test_master_weights_train_in_bf16_through_a_pipeline(pool: WorkerPool, tmp_path: Path) -> None:
    # The stages pass fp32 activations (autocast narrows only the products), as their examples say.
    text = CASES["precision_zero0_pipeline2_data2_1f1b"]
    (plan,) = check_text(text, "pp.mesh").plans.values()
    path = tmp_path / "pp.py"
    path.write_text(render_plan(plan, "pp.mesh", text))
    got = pool.run(_master_job, 4, str(path))
    assert {g["logits"] for g in got} == {None, "torch.bfloat16"}
    assert all(g["param"] == {"torch.float32"} and all(x == x for x in g["losses"]) for g in got), got
