"""Sharded checkpoints (torch.distributed.checkpoint) saved in one layout, loaded in others."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from rt_models import VOCAB, gpt2_model, llama_model, split_stages, vocab_loss

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool
from meshllm_dsl.runtime.train import checkpoint

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


# ---------------------------------------------------------------- atomic, verified, refused


def _tp2(ctx: RankContext, layers: int = 4) -> rt.Built:
    program = rt.Program(
        model=llama_model(layers),
        axes=(("tensor", 2),),
        stages=split_stages("llama", layers, 1),
        loss=vocab_loss,
    )
    return program.build(ctx.mesh(program.axes), seed=1)


def _steps_job(ctx: RankContext, root: str, steps: list[int], keep: int) -> list[str]:
    built = _tp2(ctx)
    for step in steps:
        tokens = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(step))
        built.train_step(tokens, tokens.roll(1, dims=1))
        checkpoint.save(built, root, step=step, state={"step": step}, keep=keep)
    return sorted(p.name for p in Path(root).iterdir())


def _load_error_job(ctx: RankContext, path: str, layers: int = 4) -> str:
    built = _tp2(ctx, layers)
    try:
        checkpoint.load(built, path, optimizer=True)
    except checkpoint.CheckpointError as err:
        return str(err)
    return "loaded"


def test_save_keeps_the_newest_and_points_latest_at_the_last(
    pool: WorkerPool, tmp_path: Path
) -> None:
    names = pool.run(_steps_job, 2, str(tmp_path), [1, 2, 3], 2)[0]
    assert names == ["latest", "step-000002", "step-000003"]
    assert (tmp_path / "latest").read_text().strip() == "step-000003"
    manifest = checkpoint.verify(tmp_path)
    assert manifest["step"] == 3 and manifest["state"] == {"step": 3}
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "rng-0.pt", "rng-1.pt"}


def _tamper(step_dir: Path, how: str) -> None:
    shard = step_dir / "__1_0.distcp"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "overwritten":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "no manifest":
        (step_dir / "manifest.json").unlink()
    elif how == "extra file":
        (step_dir / "__2_0.distcp").write_bytes(b"stale")
    elif how == "missing file":
        shard.unlink()
    elif how == "bad latest":
        (step_dir.parent / "latest").write_text("step-000009\n")


TAMPERED = {
    "truncated": "file __1_0.distcp has 100 bytes, the manifest says",
    "overwritten": "file __1_0.distcp fails its sha256 check",
    "no manifest": "no manifest.json: an incomplete save or not written by meshllm",
    "extra file": "file __2_0.distcp is not in the manifest",
    "missing file": "file __1_0.distcp is missing",
    "bad latest": "`latest` names step-000009, which is missing",
}


def test_a_partial_mixed_or_foreign_checkpoint_is_refused_with_one_line(
    pool: WorkerPool, tmp_path: Path
) -> None:
    clean = tmp_path / "clean"
    pool.run(_steps_job, 2, str(clean), [1], 3)
    for how, expected in TAMPERED.items():
        root = tmp_path / how.replace(" ", "-")
        shutil.copytree(clean, root)
        _tamper(root / "step-000001", how)
        path = root if how in ("bad latest", "truncated") else root / "step-000001"
        errors = pool.run(_load_error_job, 2, str(path))
        assert errors[0] == errors[1], how  # every rank stops with the same line
        assert expected in errors[0] and "\n" not in errors[0], (how, errors[0])
    # Another model: 4 layers saved, 2 expected (9 tensors per block).
    error = pool.run(_load_error_job, 2, str(clean), 2)[0]
    assert "is of another model: tensors 18 unexpected (blocks.2." in error, error
    # Weights only (no optimizer state) cannot be resumed, only loaded.
    assert pool.run(_load_error_job, 2, str(clean))[0] == "loaded"


def _weights_only_job(ctx: RankContext, root: str) -> str:
    built = _tp2(ctx)
    checkpoint.save(built, root, step=0, optimizer=False)
    return _load_error_job(ctx, root)


def test_weights_only_checkpoints_cannot_be_resumed(pool: WorkerPool, tmp_path: Path) -> None:
    assert "holds weights only" in pool.run(_weights_only_job, 2, str(tmp_path))[0]


def test_an_interrupted_save_leaves_the_previous_checkpoint_in_charge(
    pool: WorkerPool, tmp_path: Path
) -> None:
    pool.run(_steps_job, 2, str(tmp_path), [1], 3)
    before = {p.name: p.read_bytes() for p in (tmp_path / "step-000001").iterdir()}
    # What a crash at any point of a save leaves: a temporary sibling, complete or not, and
    # `latest` still naming the previous step.
    shutil.copytree(tmp_path / "step-000001", tmp_path / ".tmp-step-000002")
    (tmp_path / ".tmp-step-000002" / "__0_0.distcp").write_bytes(b"half")
    assert checkpoint.resolve(tmp_path) == tmp_path / "step-000001"
    assert pool.run(_load_error_job, 2, str(tmp_path))[0] == "loaded"
    # The next save clears the leftover and proceeds.
    names = pool.run(_steps_job, 2, str(tmp_path), [2], 3)[0]
    assert names == ["latest", "step-000001", "step-000002"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-000001").iterdir()} == before


def test_the_save_root_must_be_empty_or_hold_checkpoints(tmp_path: Path) -> None:
    checkpoint.check_save_root(tmp_path / "new" / "dir")  # created on the first save
    checkpoint.check_save_root(tmp_path)  # empty
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match="not meshllm checkpoints \\(notes.txt\\)"):
        checkpoint.check_save_root(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="exists and is not a directory"):
        checkpoint.check_save_root(tmp_path / "notes.txt")
    with pytest.raises(checkpoint.CheckpointError, match="is not a directory"):
        checkpoint.check_save_root(tmp_path / "notes.txt" / "below")
