"""Hostile checkpoint roots and manifests (issue 21 items 2 and 9, issue 26 item 5).

A `--save` root holding checkpoints another run wrote is refused before the first step unless the
run `--resume`s their lineage (from no earlier than `latest`) or `--save-over` says to start over;
`--keep` prunes only the saving run's lineage.  A manifest of the wrong shape is one line naming
the field.  The checks are plain functions over files: most cases call them in-process on
checkpoint directories written here (a manifest, no tensors), a few run real saves on the pool.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import run_module
from rt_models import VOCAB, llama_model, split_stages, vocab_loss

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool
from meshllm_dsl.runtime.train import checkpoint

SHA = "0" * 64


def _step(root: Path, step: int, run: str | None, **extra: Any) -> Path:
    """A complete-looking checkpoint ``root/step-NNNNNN`` of run ``run`` (a manifest, one file)."""
    d = root / checkpoint.step_name(step)
    d.mkdir(parents=True)
    (d / "rng-0.pt").write_bytes(b"x")
    manifest: dict[str, Any] = {
        "format": checkpoint.FORMAT, "step": step, "model": "m", "optimizer": True,
        "layout": {"axes": [["tensor", 1]], "ranks": [0]}, "param_groups": [], "state": {"step": step},
        "files": {"rng-0.pt": {"size": 1, "sha256": SHA}},
    }
    if run is not None:
        manifest["run"] = run
    manifest.update(extra)
    (d / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    (root / checkpoint.LATEST).write_text(d.name + "\n")
    return d


def _root(tmp: Path, runs: list[tuple[int, str | None]], latest: int | None = None) -> Path:
    root = tmp / "ckpt"
    for step, run in runs:
        _step(root, step, run)
    if latest is not None:
        (root / checkpoint.LATEST).write_text(checkpoint.step_name(latest) + "\n")
    return root


# ---------------------------------------------------------------- whose root is it


# (checkpoints in the root, latest, --resume (relative to tmp) or None, --save-over, refusal or None)
ROOTS: dict[str, tuple[list[tuple[int, str | None]], int | None, str | None, bool, str | None]] = {
    "a new run into another run's root": (
        [(1, "a"), (2, "a"), (3, "a")], None, None, False,
        "holds 3 checkpoints (step-000001 .. step-000003, latest step-000003) that this new run did not write;"
        " --resume {root} continues them, --save-over starts this run over in it"),
    "a new run into a root with a later checkpoint": (
        [(10, "a")], None, None, False, "holds 1 checkpoint (step-000010, latest step-000010) that this new run"),
    "a new run over checkpoints without a run id": (
        [(1, None)], None, None, False, "that this new run did not write"),
    "--save-over": ([(1, "a"), (2, "a")], None, None, True, None),
    "--resume of the root's latest": ([(1, "a"), (2, "a")], None, "ckpt", False, None),
    "--resume of its latest step directory": ([(1, "a"), (2, "a")], None, "ckpt/step-000002", False, None),
    "--resume of an earlier step": (
        [(3, "a"), (10, "a")], None, "ckpt/step-000003", False,
        "its latest is step-000010, later than step 3 that --resume {tmp}/ckpt/step-000003 continues from,"
        " and this run would move `latest` back"),
    "--resume of an earlier step with --save-over": ([(3, "a"), (10, "a")], None, "ckpt/step-000003", True, None),
    "--resume of another run": (
        [(1, "a"), (2, "a")], None, "other/step-000005", False,
        "of which step-000001, step-000002 were not written by the run that --resume"),
    "--resume into a root holding another run's too": (
        [(1, "b"), (2, "a")], None, "ckpt", False, "of which step-000001 were not written by the run"),
    "--resume of a checkpoint without a run id": ([(1, None)], None, "ckpt", False, "were not written by the run"),
    "after a crash before `latest` moved": ([(1, "a"), (2, "a")], 1, "ckpt", False, None),
}


@pytest.mark.parametrize("case", list(ROOTS))
def test_a_save_root_is_continued_only_by_its_lineage(case: str, tmp_path: Path) -> None:
    runs, latest, resume, save_over, refused = ROOTS[case]
    root = _root(tmp_path, runs, latest)
    _step(tmp_path / "other", 5, "b")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    resume_path = tmp_path / resume if resume else None
    if refused is None:
        checkpoint.check_save_root(root, resume_path, save_over)
    else:
        with pytest.raises(checkpoint.CheckpointError) as err:
            checkpoint.check_save_root(root, resume_path, save_over)
        message = str(err.value)
        assert message.startswith(f"--save {root}: ") and "\n" not in message, message
        assert refused.format(root=root, tmp=tmp_path) in message, message
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # a check writes nothing


# ---------------------------------------------------------------- manifests of the wrong shape


def _manifest(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def go(d: Path) -> None:
        m = json.loads((d / checkpoint.MANIFEST).read_text())
        change(m)
        (d / checkpoint.MANIFEST).write_text(json.dumps(m))
    return go


def _raw(data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / checkpoint.MANIFEST).write_bytes(data)


MANIFESTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "no files": (_manifest(lambda m: m.pop("files")), "`files` is missing; expected an object of file name"),
    "files a list": (_manifest(lambda m: m.update(files=["rng-0.pt"])),
                     '`files` is ["rng-0.pt"] (a list); expected an object'),
    "an entry without size": (_manifest(lambda m: m["files"]["rng-0.pt"].pop("size")),
                              "`files.rng-0.pt.size` is missing; expected a byte count"),
    "a size as text": (_manifest(lambda m: m["files"]["rng-0.pt"].update(size="1")),
                       '`files.rng-0.pt.size` is "1" (a string); expected a byte count'),
    "an entry not an object": (_manifest(lambda m: m["files"].update({"rng-0.pt": 1})),
                               "`files.rng-0.pt` is 1 (an integer); expected an object {size, sha256}"),
    "no sha256": (_manifest(lambda m: m["files"]["rng-0.pt"].pop("sha256")),
                  "`files.rng-0.pt.sha256` is missing; expected 64 hexadecimal digits"),
    "an entry outside": (_manifest(lambda m: m["files"].update({"../../etc/passwd": {"size": 1, "sha256": SHA}})),
                         '`files` is "../../etc/passwd" (a string); expected names of files inside'),
    "no step": (_manifest(lambda m: m.pop("step")), "`step` is missing; expected the step it was saved at"),
    "step as text": (_manifest(lambda m: m.update(step="3")), '`step` is "3" (a string); expected the step'),
    "no layout": (_manifest(lambda m: m.pop("layout")), "`layout` is missing; expected an object {axes, ranks}"),
    "state a list": (_manifest(lambda m: m.update(state=[1])), "`state` is [1] (a list); expected an object"),
    "state.step as text": (_manifest(lambda m: m["state"].update(step="x")), '`state.step` is "x" (a string)'),
    "param_groups an object": (_manifest(lambda m: m.update(param_groups={})),
                               "`param_groups` is {} (an object); expected a list of objects"),
    "a list": (_raw(b"[]"), "manifest.json is not a meshllm-checkpoint/1 manifest"),
    "not JSON": (_raw(b"{"), "unreadable manifest.json"),
    "nested deeply": (_raw(b"[" * 100_000), "unreadable manifest.json"),
    "not UTF-8": (_raw(b'{"format": "\xff"}'), "unreadable manifest.json"),
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_manifest_of_the_wrong_shape_is_one_line_naming_the_field(case: str, tmp_path: Path) -> None:
    mutate, expected = MANIFESTS[case]
    d = _step(tmp_path, 3, "a")
    mutate(d)
    for path in (d, tmp_path):  # the step directory, and the root through `latest`
        with pytest.raises(checkpoint.CheckpointError) as err:
            checkpoint.verify(path, checksums=False)
        message = str(err.value)
        assert expected in message and str(d) in message and "\n" not in message, message


def test_a_garbled_latest_is_one_line(tmp_path: Path) -> None:
    _step(tmp_path, 1, "a")
    (tmp_path / checkpoint.LATEST).write_bytes(b"\xff\xfe step")
    with pytest.raises(checkpoint.CheckpointError, match="`latest` holds .*, not a step"):
        checkpoint.verify(tmp_path)


# ---------------------------------------------------------------- pruning, on real saves


def _tp2(ctx: RankContext) -> rt.Built:
    program = rt.Program(model=llama_model(2), axes=(("tensor", 2),), stages=split_stages("llama", 2, 1),
                         loss=vocab_loss)
    return program.build(ctx.mesh(program.axes), seed=1)


def _run_job(ctx: RankContext, root: str, steps: list[int], keep: int, resume: bool) -> str:
    """One run: optionally resumed from ``root``, then saving ``steps``; its lineage."""
    built = _tp2(ctx)
    if resume:
        checkpoint.load(built, root, optimizer=True)
    for step in steps:
        tokens = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(step))
        built.train_step(tokens, tokens.roll(1, dims=1))
        checkpoint.save(built, root, step=step, state={"step": step}, keep=keep)
    return checkpoint.lineage(built)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keep_prunes_only_the_saving_runs_lineage_and_a_resumed_run_inherits_it(
    pool: WorkerPool, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    a = pool.run(_run_job, 2, str(root), [1, 2, 3], 3, False)[0]
    # Another run (what --save-over lets in) with --keep 1: run a's three checkpoints stay.
    b = pool.run(_run_job, 2, str(root), [5, 6], 1, False)[0]
    assert a != b
    assert _names(root) == ["latest", "step-000001", "step-000002", "step-000003", "step-000006"]
    assert [checkpoint.run_of(root / n) for n in _names(root)[1:]] == [a, a, a, b]
    # Resuming run b continues its lineage: its own older step is pruned, a's are not.
    c = pool.run(_run_job, 2, str(root), [7], 1, True)[0]
    assert c == b and checkpoint.verify(root)["run"] == b
    assert _names(root) == ["latest", "step-000001", "step-000002", "step-000003", "step-000007"]


def _meshc_run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_module("meshllm_dsl", "run", *args, timeout=300, cwd=cwd)


SPEC = """mesh m { axes tensor = 2 }
model m = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }
plan p on m for m {
    batch = 4
    seq = 8
    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
}
"""


def test_meshc_run_refuses_a_new_run_into_a_root_of_checkpoints_and_save_over_keeps_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshllm_dsl.cli import job as cli_job
    from meshllm_dsl.cli import main as cli

    spec = tmp_path / "m.mesh"
    spec.write_text(SPEC)
    root = _root(tmp_path, [(1, "a"), (2, "a"), (10, "a")])
    before = {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    def no_launch(*args: object, **kwargs: object) -> int:
        raise AssertionError("a rank was started")

    # The refusal comes before any rank starts, so meshc's own main runs it in-process.
    with monkeypatch.context() as m:
        m.setattr(cli_job, "run_job", no_launch)
        assert cli.main(["run", str(spec), "--steps", "2", "--save", str(root), "--keep", "1"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert f"--save {root}: holds 3 checkpoints" in line and "--save-over" in line and "--resume" in line
    assert {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    # --save-over: the other run's checkpoints are kept (never pruned), `latest` names this run's.
    proc = _meshc_run(str(spec), "--steps", "2", "--save", str(root), "--keep", "1", "--save-over", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _names(root) == ["latest", "step-000001", "step-000002", "step-000010"]
    assert (root / "latest").read_text().strip() == "step-000002"
    assert checkpoint.run_of(root / "step-000002") not in (None, "a")
    assert (root / "step-000001" / checkpoint.MANIFEST).read_bytes() == before[str(root / "step-000001" / "manifest.json")]
    assert (root / "step-000010" / checkpoint.MANIFEST).read_bytes() == before[str(root / "step-000010" / "manifest.json")]


# ---------------------------------------------------------------- DCP's .metadata is a pickle


class _Touch:
    """Unpickles as a call of os.system: what a hostile `.metadata` would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        import os

        return (os.system, (f"touch {self.marker}",))


def _bytes_entry(metadata: Any) -> Any:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    key = sorted(metadata.state_dict_metadata)[0]
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    return metadata


def _load_job(ctx: RankContext, path: str) -> str:
    built = _tp2(ctx)
    try:
        checkpoint.load(built, path, optimizer=True)
    except checkpoint.CheckpointError as err:
        return str(err)
    return "loaded"


def _rewrite_metadata(step_dir: Path, data: bytes) -> None:
    """Replace .metadata and update the manifest to match, as whoever wrote a hostile one would."""
    import hashlib

    (step_dir / ".metadata").write_bytes(data)
    m = json.loads((step_dir / checkpoint.MANIFEST).read_text())
    m["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / checkpoint.MANIFEST).write_text(json.dumps(m))


def test_a_metadata_pickle_that_would_run_code_or_a_setting_of_another_type_is_refused(pool: WorkerPool, tmp_path: Path) -> None:
    import pickle

    root = tmp_path / "ckpt"
    pool.run(_run_job, 2, str(root), [1], 1, False)
    step = root / "step-000001"
    assert pool.run(_load_job, 2, str(root))[0] == "loaded"  # what DCP writes is allowed
    original = (step / ".metadata").read_bytes()
    marker = tmp_path / "ran"
    _rewrite_metadata(step, pickle.dumps(_Touch(marker)))
    errors = pool.run(_load_job, 2, str(root))
    assert errors[0] == errors[1] and "refers to posix.system" in errors[0] and "\n" not in errors[0], errors
    assert not marker.exists()
    _rewrite_metadata(step, pickle.dumps(_bytes_entry(pickle.loads(original))))
    error = pool.run(_load_job, 2, str(root))[0]
    assert "is BytesStorageMetadata, not a tensor" in error, error
    # An optimizer setting of another type would fail inside the first step instead.
    _rewrite_metadata(step, original)
    m = json.loads((step / checkpoint.MANIFEST).read_text())
    m["param_groups"][0]["lr"] = "fast"
    (step / checkpoint.MANIFEST).write_text(json.dumps(m))
    error = pool.run(_load_job, 2, str(root))[0]
    assert f"checkpoint {step}: `param_groups[0].lr` is \"fast\" (a string); this run's is" in error, error


def test_save_over_needs_a_save_root_and_the_flags_check_the_root(tmp_path: Path) -> None:
    from meshllm_dsl.runtime.train import launch

    with pytest.raises(launch.InputError, match="--save-over needs --save DIR"):
        launch.check_inputs(launch.parse_args(["--save-over"]))
    root = _root(tmp_path, [(1, "a")])
    with pytest.raises(launch.InputError, match=f"--save {root}: holds 1 checkpoint"):
        launch.check_inputs(launch.parse_args(["--save", str(root)]))
    launch.check_inputs(launch.parse_args(["--save", str(root), "--save-over"]))
    launch.check_inputs(launch.parse_args(["--save", str(root), "--resume", "latest"]))
