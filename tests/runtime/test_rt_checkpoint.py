"""Sharded checkpoints (torch.distributed.checkpoint) saved in one layout, loaded in others."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rt_models import VOCAB, gpt2_model, llama_model, split_stages, vocab_loss

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime import checkpoint
from meshllm_dsl.runtime.pool import RankContext, WorkerPool

LAYOUTS: dict[str, dict[str, Any]] = {
    "pipeline2xtensor2": {
        "axes": (("pipeline", 2), ("tensor", 2)),
        "pipeline_axis": "pipeline",
        "stages": 2,
    },
    "data2xtensor4": {"axes": (("data", 2), ("tensor", 4)), "batch_axes": ("data",)},
    "single": {"axes": (("tensor", 1),)},
    "pipeline2-interleaved": {
        "axes": (("pipeline", 2), ("tensor", 1)),
        "pipeline_axis": "pipeline",
        "stages": 4,
    },
}


def _built(ctx: RankContext, kind: str, layout: str, seed: int) -> rt.Built:
    spec = LAYOUTS[layout]
    program = rt.Program(
        model=llama_model(4) if kind == "llama" else gpt2_model(4),
        axes=spec["axes"],
        stages=split_stages(kind, 4, spec.get("stages", 1), tie=kind == "gpt2"),
        loss=vocab_loss,
        pipeline_axis=spec.get("pipeline_axis"),
        batch_axes=spec.get("batch_axes", ()),
        schedule="interleaved_1f1b" if spec.get("stages", 1) > 2 else "gpipe",
    )
    return program.build(ctx.mesh(spec["axes"]), seed=seed)


def _save_job(ctx: RankContext, kind: str, layout: str, path: str) -> dict[str, torch.Tensor]:
    built = _built(ctx, kind, layout, seed=1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4, 8), generator=gen)
    built.train_step(tokens, tokens.roll(1, dims=1))  # weights no longer what any seed gives
    checkpoint.save(built, path)
    return built.full_state_dict()


def _load_job(ctx: RankContext, kind: str, layout: str, path: str) -> dict[str, torch.Tensor]:
    built = _built(ctx, kind, layout, seed=2)
    checkpoint.load(built, path)
    return built.full_state_dict()


@pytest.mark.parametrize(
    ("kind", "source", "targets"),
    [
        ("gpt2", "pipeline2xtensor2", ["data2xtensor4", "single", "pipeline2-interleaved"]),
        ("llama", "data2xtensor4", ["pipeline2xtensor2", "single"]),
    ],
)
def test_checkpoint_reshards_across_layouts(
    pool: WorkerPool, tmp_path: Path, kind: str, source: str, targets: list[str]
) -> None:
    def ranks(layout: str) -> int:
        n = 1
        for _, size in LAYOUTS[layout]["axes"]:
            n *= size
        return n

    saved = pool.run(_save_job, ranks(source), kind, source, str(tmp_path))[0]
    for target in targets:
        for loaded in pool.run(_load_job, ranks(target), kind, target, str(tmp_path)):
            assert loaded.keys() == saved.keys()
            for name, value in saved.items():
                assert torch.equal(loaded[name], value), (target, name)
