"""ZeRO 1 with `precision { params = bf16, master = fp32 }`: Megatron's distributed optimizer, run by
FSDP2 (runtime/parallel/fsdp.py), on gloo ranks of the shared pool, in bf16 as a plan trains.

Sharding the fp32 master weights and moments over data changes no number: two data ranks end with
the weights a single rank computes from the same microbatches in the same order (bit for bit: the
fp32 sum of two bf16 gradients does not depend on which rank adds it). Gradients are reduced once a
step whatever the microbatches (ZeRO 2 reduces each), as `meshc plan` counts them; each rank holds
its share of the fp32 master weights, their gradients and moments. (Equivalence to the unsharded
model in fp32 / fp64: tests/integration/test_data_parallel_layouts.py; small updates kept that bf16
rounds away: its test_master_weights_at_zero_0_and_1_keep_updates_bf16_would_round_away.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mesh_snippets import MEGATRON  # noqa: E402 - after the torch skip

from meshllm_dsl.checker import check_text  # noqa: E402 - after the torch skip
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402 - after the torch skip
from meshllm_dsl.planner.analyze import analyze  # noqa: E402 - after the torch skip
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool  # noqa: E402 - after the torch skip

LLAMA = "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64, dtype = bf16 }"
STEPS = 3


def _compile(tmp_path: Path, name: str, data: int, microbatches: int, zero: int, tensor: int = 1) -> tuple[Any, str]:
    axes, layout = (f"data = {data}, tensor = {tensor}", MEGATRON) if tensor > 1 else (f"data = {data}", "")
    text = (f"mesh g {{ axes {axes} }}\n{LLAMA}\nplan p on g for m {{\n    batch = 8\n    seq = 8\n"
            f"    microbatches = {microbatches}\n    layout {{ batch -> data }}\n{layout}"
            "    precision { params = bf16, master = fp32 }\n"
            f"    optimizer adamw {{ zero {zero}\n lr = 1e-3\n weight_decay = 0.1 }}\n}}\n")
    result = check_text(text, f"{name}.mesh")
    assert result.ok, [str(d.message) for d in result.errors]
    (plan,) = result.plans.values()
    path = tmp_path / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", text))
    return plan, str(path)


def _train_job(ctx: RankContext, path: str) -> dict[str, Any]:
    from meshllm_dsl.runtime.parallel.fsdp import data_local
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.runtime.train.profile import CollectiveLog
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    log = CollectiveLog(built.mesh)
    with log:
        losses = [built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 3, s))
                  for s in range(STEPS)]
    params = built.parameters()
    inner = getattr(built.optimizer, "optim", built.optimizer)
    moments = [v for st in inner.state.values() for k, v in st.items() if k != "step"]
    calls = {op: int(stat[0]) for (axes, op), stat in log.stats.items() if axes == "data"}
    return {
        "losses": losses,
        "state": built.full_state_dict(),
        "held": sum(data_local(p).numel() for p in params),
        "numel": sum(p.numel() for p in params),
        "dtypes": ({str(p.dtype) for p in params}, {str(p.grad.dtype) for p in params if p.grad is not None},
                   {str(v.dtype) for v in moments}),
        "moment_elements": sum(data_local(v).numel() for v in moments),
        "calls": calls,
        "fused": inner.defaults.get("fused"),
    }


def _build_job(ctx: RankContext, path: str) -> None:
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    program.build(ctx.mesh(program.axes), seed=0)


def test_sharded_master_weights_train_as_one_rank_does(pool: WorkerPool, tmp_path: Path) -> None:
    # Two data ranks, one microbatch each, against one rank with both as its two microbatches: the
    # same bf16 gradients (the loss / 2 of a microbatch scales them exactly), summed in fp32.
    _, sharded = _compile(tmp_path, "sharded", data=2, microbatches=1, zero=1)
    _, whole = _compile(tmp_path, "whole", data=1, microbatches=2, zero=1)
    # On ranks that have built an FSDP2 plan over one data rank and two tensor ranks before, as
    # the shared pool's have: FSDP2 then gave one rank's parameters equal but distinct data
    # meshes, the optimizer took them for two kinds and stepped unfused, and the weights differed
    # in the last bits (runtime/train/program.py `_make_optimizer`).
    _, other = _compile(tmp_path, "other", data=1, microbatches=1, zero=3, tensor=2)
    pool.run(_build_job, 2, other)
    got = pool.run(_train_job, 2, sharded)
    (ref,) = pool.run(_train_job, 1, whole)
    assert ref["held"] == ref["numel"]  # one rank: the master weights whole
    for rank in [*got, ref]:
        assert rank["fused"] is True  # torch's fused AdamW, as a fresh rank steps it
    for rank in got:
        assert rank["dtypes"] == ({"torch.float32"},) * 3, rank["dtypes"]
        # Each rank holds about half of every fp32 master weight, and its moments (FSDP2's dim-0 chunks).
        assert rank["held"] < 0.6 * rank["numel"] and rank["moment_elements"] == 2 * rank["held"]
        # (the reported loss is a mean taken in another order: over ranks, not microbatches)
        assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        assert rank["state"].keys() == ref["state"].keys()
        for name, value in ref["state"].items():
            assert torch.equal(rank["state"][name], value), name
    assert sum(r["held"] for r in got) == got[0]["numel"]
    # The weights moved: the comparison is not of two untrained models.
    (untrained,) = pool.run(_untrained_job, 1, whole)
    assert all(not torch.equal(untrained[k], v) for k, v in ref["state"].items() if v.dim() == 2)


def _untrained_job(ctx: RankContext, path: str) -> dict[str, Any]:
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    return program.build(ctx.mesh(program.axes), seed=0).full_state_dict()


@pytest.mark.parametrize("zero", [1, 2])
def test_zero1_reduces_gradients_once_a_step_as_planned(zero: int, pool: WorkerPool, tmp_path: Path) -> None:
    # 4 blocks and the stage root are 5 FSDP2 units; 2 microbatches. ZeRO 1 gathers and
    # reduce-scatters each unit once a step (the first microbatch's gradients accumulate whole in
    # fp32), ZeRO 2 once per microbatch; the planner counts the same.
    plan, path = _compile(tmp_path, f"zero{zero}", data=2, microbatches=2, zero=zero)
    got = pool.run(_train_job, 2, path)
    (rc,) = analyze(plan).ranks
    planned = {c.op: c.calls for c in rc.comms if c.kind == "data"}
    per_step = 5 * (1 if zero == 1 else 2)
    assert planned == {"all_gather": per_step, "reduce_scatter": per_step}, planned
    for rank in got:
        calls = rank["calls"]
        assert calls.get("reduce_scatter_single") == STEPS * per_step, calls
        assert calls.get("all_gather_single") == STEPS * per_step, calls
