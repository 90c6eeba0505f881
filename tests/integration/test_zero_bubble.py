"""The schedules beyond 1F1B (issue 39) on real gloo ranks vs the unsharded reference: looped BFS,
interleaved zero bubble, ZBV and DualPipeV, run by torch's own classes.

Each case compiles a spec, trains it 3 AdamW steps on the shared worker pool and compares forward
logits, step-0 gradients, every step's loss and every parameter afterwards with the reference model
(compare_job). The zero-bubble schedules split each backward into input-gradient and weight-gradient
work; ZBV and DualPipeV place stages in a V, so rank 0 holds the first stage and the last (a tied
embedding and head then live on one rank, twice) and the V's turn passes activations on one rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mesh_snippets import MEGATRON  # noqa: E402
from reference_jobs import assert_spec_matches_reference  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool  # noqa: E402
from meshllm_dsl.verify.equivalence import load_generated  # noqa: E402

LLAMA = """
model m = llama { vocab = 64, hidden = 32, layers = 8, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }
"""
GPT2 = """
model m = gpt2 { vocab = 64, hidden = 32, layers = 8, heads = 4, positions = 16 }
"""
REPLICATED = "".join(f" shard {p} replicate\n" for p in ("embed", "lm_head", "blocks.*.attn.{q,k,v,o}", "blocks.*.mlp.router"))
MIXTRAL = """
model m = mixtral { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 32, experts = 4, top_k = 2, dtype = fp32 }
"""


def _spec(axes: str, body: str, model: str = LLAMA, batch: int = 8) -> str:
    return f"mesh m {{ axes {axes} }}\n{model}\nplan p on m for m {{\n    batch = {batch}\n    seq = 8\n{body}\n}}\n"


def _pipe(schedule: str, virtual: int, micro: int) -> str:
    v = f" virtual {virtual}" if virtual > 1 else ""
    return f"microbatches = {micro}\n stages over pipeline{v} balanced\n schedule {schedule}\n"


CASES: dict[str, str] = {
    "zbv_pipeline2": _spec("pipeline = 2", _pipe("zbv", 2, 4)),
    "dualpipev_pipeline2": _spec("pipeline = 2", _pipe("dualpipev", 2, 4)),
    "interleaved_zb_pipeline2": _spec("pipeline = 2", _pipe("interleaved_zb", 1, 4)),
    "interleaved_zb_pipeline2_virtual2": _spec("pipeline = 2", _pipe("interleaved_zb", 2, 4)),
    "looped_bfs_pipeline2_virtual2": _spec("pipeline = 2", _pipe("looped_bfs", 2, 4)),
    "zbv_pipeline4": _spec("pipeline = 4", _pipe("zbv", 2, 8)),
    # Fewer microbatches than the V needs to fill (2p - 1): torch pads the order with idle slots.
    "zbv_pipeline4_two_microbatches": _spec("pipeline = 4", _pipe("zbv", 2, 2)),
    "interleaved_zb_pipeline4_one_microbatch": _spec("pipeline = 4", _pipe("interleaved_zb", 1, 1)),
    "dualpipev_pipeline4": _spec("pipeline = 4", _pipe("dualpipev", 2, 8)),
    # A tied embedding and head: under a V both sit on rank 0 (two copies, gradients summed there).
    "zbv_gpt2_tied_pipeline2_tensor2": _spec(
        "pipeline = 2, tensor = 2",
        "layout { heads -> tensor, ffn -> tensor, vocab -> tensor }\n" + _pipe("zbv", 2, 4), GPT2),
    "dualpipev_pipeline2_tensor2": _spec("pipeline = 2, tensor = 2", MEGATRON + _pipe("dualpipev", 2, 4)),
    # Sequence parallelism: the residual stream [b, s / t, h] between stages and across the V's turn.
    "zbv_pipeline2_tensor2_sequence_parallel": _spec(
        "pipeline = 2, tensor = 2", MEGATRON + "layout { seq -> tensor }\n" + _pipe("zbv", 2, 4)),
    # Context parallelism: each sequence split over `cp` through every stage.
    "interleaved_zb_pipeline2_context2": _spec(
        "pipeline = 2, cp = 2", "layout { seq -> cp }\n" + _pipe("interleaved_zb", 2, 4)),
    "interleaved_zb_pipeline2_tensor2_virtual2": _spec(
        "pipeline = 2, tensor = 2", MEGATRON + _pipe("interleaved_zb", 2, 4)),
    "zbv_data2_pipeline2_zero3": _spec(
        "data = 2, pipeline = 2", "layout { batch -> data }\n optimizer adamw { zero 3 }\n" + _pipe("zbv", 2, 4)),
    "dualpipev_data2_pipeline2_zero3": _spec(
        "data = 2, pipeline = 2", "layout { batch -> data }\n optimizer adamw { zero 3 }\n" + _pipe("dualpipev", 2, 4)),
    "interleaved_zb_data2_pipeline2_zero3": _spec(
        "data = 2, pipeline = 2", "layout { batch -> data }\n optimizer adamw { zero 3 }\n" + _pipe("interleaved_zb", 2, 4)),
    "zbv_data2_pipeline2_zero2": _spec(
        "data = 2, pipeline = 2", "layout { batch -> data }\n optimizer adamw { zero 2 }\n" + _pipe("zbv", 2, 4)),
    "looped_bfs_data2_pipeline2_zero3": _spec(
        "data = 2, pipeline = 2", "layout { batch -> data }\n optimizer adamw { zero 3 }\n" + _pipe("looped_bfs", 2, 4)),
    "interleaved_zb_data2_pipeline2_tensor2_zero1": _spec(
        "data = 2, pipeline = 2, tensor = 2",
        MEGATRON + "layout { batch -> data }\n optimizer adamw { zero 1 }\n" + _pipe("interleaved_zb", 1, 2)),
    "zbv_recompute_pipeline2": _spec("pipeline = 2", "recompute = blocks\n" + _pipe("zbv", 2, 4)),
    # Stacked expert weights whose weight gradients (computed apart by the zero-bubble schedules) come
    # back in other strides than the parameters': the optimizer must still pair them element by element.
    "zbv_mixtral_pipeline2": _spec("pipeline = 2", _pipe("zbv", 2, 4), MIXTRAL),
    "dualpipev_mixtral_pipeline2": _spec("pipeline = 2", _pipe("dualpipev", 2, 4), MIXTRAL),
    # Experts split over `data` (all-to-all inside every block), router losses carried across stages.
    "dualpipev_mixtral_data2_pipeline2_experts": _spec(
        "data = 2, pipeline = 2",
        "layout { batch -> data, experts -> data }\n" + REPLICATED + _pipe("dualpipev", 2, 4),
        MIXTRAL),
    "interleaved_zb_mixtral_data2_pipeline2_experts_zero3": _spec(
        "data = 2, pipeline = 2",
        "layout { batch -> data, experts -> data }\n optimizer adamw { zero 3 }\n" + REPLICATED
        + _pipe("interleaved_zb", 2, 4), MIXTRAL),
}


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_matches_unsharded_reference(name: str, pool: WorkerPool, tmp_path: Path) -> None:
    assert_spec_matches_reference(pool, CASES[name], name, tmp_path)


def _placement_job(ctx: RankContext, path: str) -> dict[str, Any]:
    """The stages this rank built, the ones torch's schedule runs here, and the actions it runs."""
    from meshllm_dsl.runtime.train.launch import synthetic_batch

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 7, 0))
    (schedule,) = built._schedules.values()
    kinds = sorted({a.computation_type.value for a in schedule.pipeline_order[ctx.rank] if a is not None})
    return {"built": built.stage_ids, "scheduled": sorted(s.stage_index for s in schedule._stages),
            "class": type(schedule).__name__, "actions": kinds}


@pytest.mark.parametrize(("schedule", "cls", "ranks", "kinds"), [
    ("zbv", "ScheduleZBVZeroBubble", [[0, 7], [1, 6], [2, 5], [3, 4]], {"F", "I", "W"}),
    ("dualpipev", "ScheduleDualPipeV", [[0, 7], [1, 6], [2, 5], [3, 4]], {"F", "I", "W", "B", "OVERLAP_F_B"}),
    ("interleaved_zb", "ScheduleInterleavedZeroBubble", [[0, 4], [1, 5], [2, 6], [3, 7]], {"F", "I", "W"}),
    ("looped_bfs", "ScheduleLoopedBFS", [[0, 4], [1, 5], [2, 6], [3, 7]], {"F", "B"}),
])
def test_each_schedule_runs_torchs_class_on_its_placement(
    schedule: str, cls: str, ranks: list[list[int]], kinds: set[str], pool: WorkerPool, tmp_path: Path
) -> None:
    text = _spec("pipeline = 4", _pipe(schedule, 2, 8))
    (plan,) = check_text(text, "p.mesh").plans.values()
    assert [[s.index for s in plan.stages if s.coord == r] for r in range(4)] == ranks  # the checker's placement
    path = tmp_path / "p.py"
    path.write_text(render_plan(plan, "p.mesh", text))
    got = pool.run(_placement_job, 4, str(path))
    assert [g["built"] for g in got] == ranks
    assert [g["scheduled"] for g in got] == ranks
    assert {g["class"] for g in got} == {cls}
    assert set().union(*(g["actions"] for g in got)) == kinds


def test_meshc_verify_reports_equal_for_the_zbv_example() -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "meshllm_dsl", "verify", str(root / "examples" / "tiny_llama_zbv.mesh")],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: EQUAL" in proc.stdout
