"""The whole training state through a checkpoint: resume exactly, on the same and other layouts.

Also the layout-independent keys of fused tensors (issue 8, item 5): a GPT-2 checkpoint from a plan
that shards the fused qkv loads into one that does not (whose specs carry no segments, as
``meshc`` generates them) and back, for every pair of a replicated, a tensor and a pipeline x
tensor plan of both families.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from rt_models import StageDef, gpt2_model, llama_model, split_stages, vocab_loss

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool
from meshllm_dsl.runtime.train import checkpoint
from meshllm_dsl.runtime.train.launch import synthetic_batch

LAYERS = 4
# With clipping that bites and a warmup + cosine schedule that spans the resume point, so a resumed
# run must also restore the schedule's clock (the step) to stay bit for bit.
OPT = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "clip": 0.05, "warmup": 2, "decay_steps": 6,
       "min_lr": 3e-4}

LAYOUTS: dict[str, dict[str, Any]] = {
    "single": {"axes": (("tensor", 1),)},
    "tensor2": {"axes": (("tensor", 2),)},
    "data2xtensor2-zero1": {
        "axes": (("data", 2), ("tensor", 2)),
        "batch_axes": ("data",),
        "zero": 1,
    },
    "pipeline2xtensor2": {
        "axes": (("pipeline", 2), ("tensor", 2)),
        "pipeline_axis": "pipeline",
        "stages": 2,
        "schedule": "1f1b",
    },
    "data2xpipeline2xtensor2-zero1": {
        "axes": (("data", 2), ("pipeline", 2), ("tensor", 2)),
        "pipeline_axis": "pipeline",
        "batch_axes": ("data",),
        "stages": 4,
        "schedule": "interleaved_1f1b",
        "zero": 1,
    },
    # ZeRO-3 / ZeRO-2 (FSDP2): parameters, gradients and optimizer states are DTensors sliced
    # over data; a checkpoint holds the same keys as any other layout's.
    "data2xtensor2-zero3": {
        "axes": (("data", 2), ("tensor", 2)),
        "batch_axes": ("data",),
        "zero": 3,
    },
    # HSDP: ZeRO over `data`, replicated over `replica` (FSDP2's 2-D mesh; ZeRO-1 over the shard group).
    "replica2xdata2-hsdp3": {"axes": (("replica", 2), ("data", 2), ("tensor", 1)), "batch_axes": ("replica", "data"), "zero": 3, "batch": 8,
                             "zero_axes": ("data",)},
    "replica2xdata2-hsdp1": {"axes": (("replica", 2), ("data", 2), ("tensor", 1)), "batch_axes": ("replica", "data"), "zero": 1, "batch": 8,
                             "zero_axes": ("data",)},
    # bf16 compute, fp32 master weights sharded with the moments over data (ZeRO-1 with master
    # weights, Megatron's distributed optimizer: FSDP2), alone and with tensor parallelism.
    "data2-bf16-master-zero1": {"axes": (("data", 2), ("tensor", 1)), "batch_axes": ("data",), "zero": 1,
                                "param_dtype": torch.bfloat16},
    "data2xtensor2-bf16-master-zero1": {"axes": (("data", 2), ("tensor", 2)), "batch_axes": ("data",), "zero": 1,
                                        "param_dtype": torch.bfloat16},
    # and at ZeRO 0, the whole fp32 parameters under autocast
    "data2-bf16-master-zero0": {"axes": (("data", 2), ("tensor", 1)), "batch_axes": ("data",),
                                "param_dtype": torch.bfloat16},
    # The zero-bubble schedules (issue 39): ZBV's and DualPipeV's V (rank 0 holds the first and the
    # last stage: gpt2's tied embedding and head twice on one rank), interleaved zero bubble's loop,
    # each backward split into input- and weight-gradient work; under ZeRO 3 too.
    "pipeline2xtensor2-zbv": {
        "axes": (("pipeline", 2), ("tensor", 2)),
        "pipeline_axis": "pipeline",
        "stages": 4,
        "schedule": "zbv",
    },
    "data2xpipeline2-dualpipev-zero3": {
        "axes": (("data", 2), ("pipeline", 2), ("tensor", 1)),
        "pipeline_axis": "pipeline",
        "batch_axes": ("data",),
        "stages": 4,
        "schedule": "dualpipev",
        "microbatches": 4,  # DualPipeV fills both arms of the V: at least as many as stages
        "batch": 8,
        "zero": 3,
    },
    "data2xpipeline2xtensor2-interleaved_zb-zero1": {
        "axes": (("data", 2), ("pipeline", 2), ("tensor", 2)),
        "pipeline_axis": "pipeline",
        "batch_axes": ("data",),
        "stages": 4,
        "schedule": "interleaved_zb",
        "zero": 1,
    },
    "pipeline2-looped_bfs": {
        "axes": (("pipeline", 2), ("tensor", 1)),
        "pipeline_axis": "pipeline",
        "stages": 4,
        "schedule": "looped_bfs",
    },
    "data2xpipeline2xtensor2-zero2": {
        "axes": (("data", 2), ("pipeline", 2), ("tensor", 2)),
        "pipeline_axis": "pipeline",
        "batch_axes": ("data",),
        "stages": 4,
        "schedule": "interleaved_1f1b",
        "zero": 2,
    },
}


@dataclasses.dataclass(frozen=True)
class Unsegmented(StageDef):
    """A stage whose fused qkv spec has no segments, as codegen emits for an unsharded qkv."""

    def params(self, prefix: str = "") -> dict[str, rt.ShardSpec]:
        return {
            k: dataclasses.replace(v, segments=None) for k, v in super().params(prefix).items()
        }


def _ranks(layout: str) -> int:
    n = 1
    for _, size in LAYOUTS[layout]["axes"]:
        n *= size
    return n


def _build(
    ctx: RankContext,
    kind: str,
    layout: str,
    seed: int,
    unsegmented: bool = False,
    dtype: torch.dtype = torch.float32,
) -> rt.Built:
    spec = LAYOUTS[layout]
    stages = split_stages(kind, LAYERS, spec.get("stages", 1), tie=kind == "gpt2")
    if unsegmented:
        stages = tuple(Unsegmented(*dataclasses.astuple(s)) for s in stages)
    program = rt.Program(
        model=llama_model(LAYERS) if kind == "llama" else gpt2_model(LAYERS),
        axes=spec["axes"],
        stages=stages,
        loss=vocab_loss,
        pipeline_axis=spec.get("pipeline_axis"),
        batch_axes=spec.get("batch_axes", ()),
        schedule=spec.get("schedule", "gpipe"),
        microbatches=spec.get("microbatches", 2),
        batch=spec.get("batch", 4),
        seq=8,
        zero=spec.get("zero", 0),
        zero_axes=spec.get("zero_axes", ()),
        param_dtype=spec.get("param_dtype"),
        optimizer=OPT,
        dtype=dtype,
    )
    return program.build(ctx.mesh(spec["axes"]), seed=seed)


def _steps(built: rt.Built, start: int, stop: int) -> list[float]:
    p = built.program
    return [built.train_step(*synthetic_batch(p.vocab, p.batch, p.seq, 7, s)) for s in range(start, stop)]


def _straight_job(
    ctx: RankContext, kind: str, layout: str, n: int, dtype: str = "float32"
) -> tuple[list[float], Any]:
    built = _build(ctx, kind, layout, seed=0, dtype=getattr(torch, dtype))
    losses = _steps(built, 0, n)
    return losses, built.full_state_dict()


def _first_half_job(
    ctx: RankContext, kind: str, layout: str, n: int, root: str, dtype: str = "float32"
) -> list[float]:
    built = _build(ctx, kind, layout, seed=0, dtype=getattr(torch, dtype))
    losses = _steps(built, 0, n)
    checkpoint.save(built, root, step=n, state={"step": n})
    return losses


def _second_half_job(
    ctx: RankContext, kind: str, layout: str, n: int, root: str, dtype: str = "float32"
) -> tuple[list[float], Any, int]:
    built = _build(ctx, kind, layout, seed=5, dtype=getattr(torch, dtype))  # other initial weights: the load must replace them
    manifest = checkpoint.load(built, root, optimizer=True)
    start = manifest["state"]["step"]
    return _steps(built, start, n), built.full_state_dict(), start


def _weights_only_job(
    ctx: RankContext, kind: str, layout: str, n: int, root: str, dtype: str = "float32"
) -> tuple[list[float], Any]:
    built = _build(ctx, kind, layout, seed=5, dtype=getattr(torch, dtype))
    start = checkpoint.load(built, root)["state"]["step"]
    return _steps(built, start, n), built.full_state_dict()


@pytest.mark.parametrize(
    ("kind", "layout"),
    [("llama", "data2xtensor2-zero1"), ("gpt2", "pipeline2xtensor2"), ("llama", "data2xtensor2-zero3"),
     ("gpt2", "data2xpipeline2xtensor2-zero2"), ("llama", "replica2xdata2-hsdp3"), ("llama", "replica2xdata2-hsdp1"),
     ("llama", "data2-bf16-master-zero1"), ("gpt2", "data2xtensor2-bf16-master-zero1"), ("llama", "data2-bf16-master-zero0"),
     ("gpt2", "pipeline2xtensor2-zbv"), ("llama", "data2xpipeline2-dualpipev-zero3"),
     ("gpt2", "data2xpipeline2xtensor2-interleaved_zb-zero1"), ("llama", "pipeline2-looped_bfs")],
)
def test_resume_on_the_same_layout_is_bit_for_bit(
    pool: WorkerPool, tmp_path: Path, kind: str, layout: str
) -> None:
    n = _ranks(layout)
    losses, final = pool.run(_straight_job, n, kind, layout, 4)[0]
    first = pool.run(_first_half_job, n, kind, layout, 2, str(tmp_path))[0]
    second, resumed, start = pool.run(_second_half_job, n, kind, layout, 4, str(tmp_path))[0]
    assert start == 2
    assert first + second == losses
    assert resumed.keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.parametrize(
    ("source", "targets"),
    [("data2xpipeline2xtensor2-zero1", ("tensor2", "single", "data2xtensor2-zero3")),
     ("data2xpipeline2xtensor2-zero2", ("tensor2", "single")),
     ("data2xtensor2-zero3", ("pipeline2xtensor2", "data2xpipeline2xtensor2-zero1"))],
)
def test_resume_on_other_layouts_matches_within_float_tolerance(
    pool: WorkerPool, tmp_path: Path, source: str, targets: tuple[str, ...]
) -> None:
    # Saved with the optimizer state sharded over data (ZeRO-1; ZeRO 2 / 3: parameters and
    # gradients too), resumed on other layouts.  In float64: in float32 AdamW amplifies the rounding
    # noise of gradients that are exactly zero in theory (the key bias) to O(lr), in any two
    # layouts alike (see runtime/jobs/compare.py), which would hide nothing but blur the check.
    kind, f64 = "gpt2", "float64"
    losses, final = pool.run(_straight_job, _ranks(source), kind, source, 4, f64)[0]
    pool.run(_first_half_job, _ranks(source), kind, source, 2, str(tmp_path), f64)
    for target in targets:
        second, resumed, _ = pool.run(
            _second_half_job, _ranks(target), kind, target, 4, str(tmp_path), f64
        )[0]
        assert second == pytest.approx(losses[2:], rel=1e-12, abs=1e-12), target
        for name, value in final.items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-10, msg=f"{target} {name}")
    # The tolerance can fail: resuming the weights without the optimizer state lands far outside.
    _, weights_only = pool.run(_weights_only_job, 1, kind, "single", 4, str(tmp_path), f64)[0]
    assert not all(
        torch.allclose(weights_only[k], v, rtol=0, atol=1e-10) for k, v in final.items()
    )


def _save_weights_job(ctx: RankContext, kind: str, layout: str, unseg: bool, root: str) -> Any:
    built = _build(ctx, kind, layout, seed=3, unsegmented=unseg)
    _steps(built, 0, 1)  # weights and optimizer state no seed gives
    checkpoint.save(built, root, step=1)
    return built.full_state_dict()


def _load_weights_job(ctx: RankContext, kind: str, layout: str, unseg: bool, root: str) -> Any:
    built = _build(ctx, kind, layout, seed=4, unsegmented=unseg)
    checkpoint.load(built, root, optimizer=True)
    return built.full_state_dict()


PLANS = {  # layout, specs without segments (what codegen emits when qkv is not split)
    "replicated": ("single", True),
    "tensor": ("tensor2", False),
    "pipeline-x-tensor": ("pipeline2xtensor2", False),
}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_checkpoint_keys_do_not_depend_on_the_layout(
    pool: WorkerPool, tmp_path: Path, kind: str
) -> None:
    for source, (layout, unseg) in PLANS.items():
        root = tmp_path / source
        saved = pool.run(_save_weights_job, _ranks(layout), kind, layout, unseg, str(root))[0]
        for target, (t_layout, t_unseg) in PLANS.items():
            if target == source:
                continue
            loaded = pool.run(_load_weights_job, _ranks(t_layout), kind, t_layout, t_unseg, str(root))
            for got in loaded:
                assert got.keys() == saved.keys()
                for name, value in saved.items():
                    assert torch.equal(got[name], value), (source, target, name)


def _loaded_job(ctx: RankContext, kind: str, layout: str, root: str) -> Any:
    built = _build(ctx, kind, layout, seed=5)
    checkpoint.load(built, root, optimizer=True)
    moments = [st["exp_avg_sq"] for st in built.optimizer.state.values() if "exp_avg_sq" in st]
    return built.full_state_dict(), moments


def test_sharded_master_weights_and_moments_load_whole_on_one_rank(pool: WorkerPool, tmp_path: Path) -> None:
    # Saved by the distributed optimizer (fp32 master weights and moments sharded over data by FSDP2),
    # loaded into one rank holding them whole: the same fp32 master weights, every moment present.
    source = "data2-bf16-master-zero1"
    _, final = pool.run(_straight_job, _ranks(source), "llama", source, 2)[0]
    pool.run(_first_half_job, _ranks(source), "llama", source, 2, str(tmp_path))
    weights, moments = pool.run(_loaded_job, 1, "llama", "single", str(tmp_path))[0]
    assert weights.keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(weights[name], value), name
    assert len(moments) == len(final) and all(bool((m > 0).any()) for m in moments)
