"""Program/Built on real plans vs the unsharded reference: 3 AdamW steps, losses and weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rt_models import VOCAB, gpt2_model, llama_model, split_stages, vocab_loss

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime.jobs.compare import TOLERANCE, compare_to_reference
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool

OPT = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
LAYERS = 4


def _batches(n: int, batch: int = 8, seq: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, VOCAB, (batch, seq), generator=gen),
            torch.randint(0, VOCAB, (batch, seq), generator=gen),
        )
        for _ in range(n)
    ]


def _train_job(ctx: RankContext, plan: dict[str, Any]) -> dict[str, dict[str, float]]:
    kind, tie = plan["kind"], plan.get("tie", False)
    model = llama_model(LAYERS, tie=tie) if kind == "llama" else gpt2_model(LAYERS)
    program = rt.Program(
        model=model,
        axes=plan["axes"],
        stages=split_stages(kind, LAYERS, plan.get("stages", 1), tie or kind == "gpt2"),
        loss=vocab_loss,
        pipeline_axis=plan.get("pipeline_axis"),
        batch_axes=plan.get("batch_axes", ()),
        schedule=plan.get("schedule", "gpipe"),
        microbatches=plan.get("microbatches", 1),
        batch=8,
        seq=8,
        zero=plan.get("zero", 0),
        optimizer=OPT,
    )
    # float64 too: float32 skips the few elements whose gradient is rounding noise (compare.py)
    mesh = ctx.mesh(plan["axes"])
    return {name: compare_to_reference(program, mesh, dtype=getattr(torch, name), seed=0, steps=3)
            for name in ("float32", "float64")}


PLANS = {
    "tensor2": {"kind": "llama", "axes": (("tensor", 2),)},
    "data2": {"kind": "llama", "axes": (("data", 2), ("tensor", 1)), "batch_axes": ("data",)},
    "data2-zero1-micro2": {
        "kind": "llama",
        "axes": (("data", 2), ("tensor", 1)),
        "batch_axes": ("data",),
        "zero": 1,
        "microbatches": 2,
    },
    "pipeline2-gpipe": {
        "kind": "llama",
        "axes": (("pipeline", 2), ("tensor", 1)),
        "pipeline_axis": "pipeline",
        "stages": 2,
        "microbatches": 2,
    },
    "pipeline2-tied-gpt2": {
        "kind": "gpt2",
        "axes": (("pipeline", 2), ("tensor", 1)),
        "pipeline_axis": "pipeline",
        "stages": 2,
        "microbatches": 4,
        "schedule": "1f1b",
    },
    "pipeline2xtensor2-1f1b": {
        "kind": "llama",
        "axes": (("pipeline", 2), ("tensor", 2)),
        "pipeline_axis": "pipeline",
        "stages": 2,
        "microbatches": 2,
        "schedule": "1f1b",
        "tie": True,
    },
    "pipeline2-interleaved": {
        "kind": "llama",
        "axes": (("pipeline", 2), ("tensor", 1)),
        "pipeline_axis": "pipeline",
        "stages": 4,
        "microbatches": 2,
        "schedule": "interleaved_1f1b",
    },
    "data2xpipeline2xtensor2-zero1": {
        "kind": "gpt2",
        "axes": (("data", 2), ("pipeline", 2), ("tensor", 2)),
        "pipeline_axis": "pipeline",
        "batch_axes": ("data",),
        "stages": 4,
        "microbatches": 2,
        "schedule": "interleaved_1f1b",
        "zero": 1,
    },
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_three_adamw_steps_match_reference(pool: WorkerPool, name: str) -> None:
    plan = PLANS[name]
    n = 1
    for _, size in plan["axes"]:
        n *= size
    for rank, errs in enumerate(pool.run(_train_job, n, plan)):
        for dtype, by_key in errs.items():
            bad = {k: v for k, v in by_key.items() if not v <= TOLERANCE[dtype]}
            assert not bad, f"rank {rank}, {dtype}: {bad}"


class _MissingNorm:
    """A stage whose params() forgets a parameter the module has."""

    def __init__(self) -> None:
        self.inner = split_stages("llama", LAYERS, 1)[0]

    def __call__(self, mesh: rt.Mesh) -> torch.nn.Module:
        return self.inner(mesh)

    def params(self, prefix: str = "") -> dict[str, rt.ShardSpec]:
        specs = self.inner.params(prefix)
        del specs["norm.weight"]
        return specs


def _coverage_job(ctx: RankContext) -> None:
    program = rt.Program(
        model=llama_model(LAYERS), axes=(("tensor", 1),), stages=(_MissingNorm(),), loss=vocab_loss
    )
    program.build(ctx.mesh(program.axes))


def test_params_must_cover_the_module_exactly(pool: WorkerPool) -> None:
    with pytest.raises(Exception, match=r"only in the module: \['norm.weight'\]"):
        pool.run(_coverage_job, 1)


def _bf16_job(ctx: RankContext) -> list[float]:
    losses = []
    for dtype in (torch.float32, torch.bfloat16):
        program = rt.Program(
            model=llama_model(LAYERS),
            axes=(("pipeline", 2), ("tensor", 2)),
            stages=split_stages("llama", LAYERS, 2),
            loss=vocab_loss,
            pipeline_axis="pipeline",
            microbatches=2,
            optimizer=OPT,
            dtype=dtype,
        )
        built = program.build(ctx.mesh(program.axes), seed=0)
        losses += [built.train_step(tokens, targets) for tokens, targets in _batches(2)]
    return losses


def test_bfloat16_trains_close_to_float32(pool: WorkerPool) -> None:
    f32a, f32b, bf16a, bf16b = pool.run(_bf16_job, 4)[0]
    assert abs(bf16a - f32a) < 0.02 and abs(bf16b - f32b) < 0.02
