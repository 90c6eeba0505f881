"""``rt.launch.main`` under real torchrun: training with a checkpoint, and a failing rank."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from processes import StderrReader
from rt_models import llama_model, split_stages, vocab_loss

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime import checkpoint, launch
from meshllm_dsl.runtime.pool import RankContext, WorkerPool
from meshllm_dsl.runtime.reference import build_reference

HERE = Path(__file__).resolve().parent


def make_loss(mesh: rt.Mesh, fail: bool) -> Any:
    loss = vocab_loss(mesh)
    calls: list[int] = []

    def checked(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if fail and mesh.rank == 1 and len(calls) == 3:
            raise RuntimeError("injected failure in the loss")
        return loss(logits, targets)

    return checked


def make_program(fail: bool) -> rt.Program:
    return rt.Program(
        model=llama_model(2),
        axes=(("pipeline", 2), ("tensor", 1)),
        stages=split_stages("llama", 2, 2),
        loss=functools.partial(make_loss, fail=fail),
        pipeline_axis="pipeline",
        schedule="1f1b",
        microbatches=2,
        batch=4,
        seq=8,
    )


# What a generated module boils down to.
MODULE = """
import meshllm_dsl.runtime as rt
from test_rt_launch import inject_faults, make_program

PROGRAM = make_program(fail={fail})

if __name__ == "__main__":
    inject_faults()
    rt.launch.main(PROGRAM)
"""


def inject_faults() -> None:
    """In the plan script: faults the tests ask for through ``TEST_FAULT``."""
    if os.environ.get("TEST_FAULT") == "kill -9 rank 1 while saving step 4":
        real_save, real_agree, at = launch.save_checkpoint, checkpoint._agree, [0]

        def save(built: rt.Built, root: Path, step: int = 0, **kw: Any) -> Path:
            at[0] = step
            return real_save(built, root, step=step, **kw)

        def agree(mesh: rt.Mesh, error: str | None) -> None:
            # Called once the shards and RNG files are written, before the manifest and rename.
            if at[0] == 4 and mesh.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            real_agree(mesh, error)

        launch.save_checkpoint, checkpoint._agree = save, agree  # type: ignore[assignment]
    if os.environ.get("TEST_FAULT") == "kill -9 rank 1 at step 5, first attempt only":
        real_mark = launch.Progress.mark

        def mark(self: launch.Progress, where: str) -> None:
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if where == "step 5" and self.rank == 1 and first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)
            real_mark(self, where)

        launch.Progress.mark = mark  # type: ignore[method-assign]


def _command(tmp_path: Path, *args: str, fail: bool = False, restarts: int = 0) -> list[str]:
    script = tmp_path / "plan.py"
    script.write_text(MODULE.format(fail=fail))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return [*cmd, f"--max-restarts={restarts}", str(script), *args]


def _env(**extra: str) -> dict[str, str]:
    # The ranks import this module (its stage classes), so they need what it imports: tests/runtime
    # and tests/ (processes.py).
    path = os.pathsep.join([str(HERE), str(HERE.parent)])
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", LOGLEVEL="WARNING", **extra)


def _torchrun(
    tmp_path: Path, *args: str, fail: bool = False, fault: str = "", restarts: int = 0
) -> subprocess.CompletedProcess[str]:
    # As `meshc run --max-restarts` does (pytorch#135712: restarted workers otherwise read their
    # peers' addresses from the previous attempt in the shared rendezvous store).
    share = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if restarts else {}
    return subprocess.run(
        _command(tmp_path, *args, fail=fail, restarts=restarts),
        env=_env(TEST_FAULT=fault, **share),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _infer_job(ctx: RankContext, ckpt: str) -> tuple[list[int], list[int]]:
    """What ``--infer --load CKPT`` runs, checked against the reference with the same weights."""
    program = make_program(fail=False)
    built = program.build(ctx.mesh(program.axes), seed=0)
    checkpoint.load(built, ckpt)
    out = launch.infer(built, 4, seed=0)
    ref = build_reference(program.model, torch.float32)
    ref.load_state_dict(built.full_state_dict())
    tokens = out[:, :-4]
    with torch.no_grad():
        for _ in range(4):
            tokens = torch.cat([tokens, ref(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[0].tolist(), tokens[0].tolist()


def test_train_and_save_then_decode_from_the_checkpoint(tmp_path: Path, pool: WorkerPool) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    ckpt = tmp_path / "ckpt"
    proc = _torchrun(tmp_path, "--steps", "3", "--data", str(data), "--save", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert "step 3/3" in proc.stderr
    summary = [line for line in proc.stderr.splitlines() if line.startswith("done: loss")]
    assert len(summary) == 1, proc.stderr
    assert "tokens/s" in summary[0] and "r0=" in summary[0] and "r1=" in summary[0]
    for got, want in pool.run(_infer_job, 2, str(ckpt)):
        assert got == want


def test_a_failing_rank_stops_the_job_promptly_and_names_the_cause(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _torchrun(tmp_path, "--steps", "5", "--timeout", "600", fail=True)
    assert proc.returncode != 0
    assert "rank 1 failed: RuntimeError: injected failure in the loss" in proc.stderr
    # Rank 0 usually also says "rank 0 stopped: a peer rank exited", but torchrun may SIGTERM it
    # before it prints (seen once in a full-suite run), so only the cause is required.
    assert time.monotonic() - start < 60


def _shards(step_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step_dir.glob("*.distcp"))}


def test_kill_9_during_a_save_keeps_the_previous_checkpoint_and_resume_is_exact(
    tmp_path: Path,
) -> None:
    straight, crash = tmp_path / "straight", tmp_path / "crash"
    proc = _torchrun(tmp_path, "--steps", "6", "--save", str(straight), "--save-every", "2")
    assert proc.returncode == 0, proc.stderr
    want_loss = [ln for ln in proc.stderr.splitlines() if ln.startswith("done: loss")][0][:16]

    proc = _torchrun(
        tmp_path, "--steps", "6", "--save", str(crash), "--save-every", "2",
        fault="kill -9 rank 1 while saving step 4",
    )
    assert proc.returncode != 0
    assert proc.stderr.count("Traceback") == 1  # torchrun's own: the ranks print lines
    # The interrupted save left its temporary sibling; `latest` still names step 2, complete and
    # equal byte for byte to what the uninterrupted run wrote at step 2.
    assert (crash / "latest").read_text().strip() == "step-000002"
    assert (crash / ".tmp-step-000004").is_dir()
    assert not (crash / "step-000004").exists()
    checkpoint.verify(crash)
    assert _shards(crash / "step-000002") == _shards(straight / "step-000002")

    proc = _torchrun(
        tmp_path, "--steps", "6", "--resume", "latest", "--save", str(crash), "--save-every", "2"
    )
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {crash / 'step-000002'} at step 2" in proc.stderr
    assert "step 6/6" in proc.stderr and "step 2/6" not in proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("done: loss")][0][:16] == want_loss
    # 2 steps + crash + resume + 4 steps == 6 steps, bit for bit.
    assert _shards(crash / "step-000006") == _shards(straight / "step-000006")
    assert not list(crash.glob(".tmp-*"))

    # With torchrun's restarts a killed rank costs the steps since the last checkpoint, no more.
    restart = tmp_path / "restart"
    proc = _torchrun(
        tmp_path, "--steps", "6", "--save", str(restart), "--save-every", "2",
        fault="kill -9 rank 1 at step 5, first attempt only", restarts=1,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {restart / 'step-000004'} at step 4" in proc.stderr
    assert _shards(restart / "step-000006") == _shards(straight / "step-000006")


def _rank_pids(parent: int) -> dict[int, int]:
    """Global rank -> pid of torchrun's workers (read from their environments)."""
    out = {}
    for task in Path(f"/proc/{parent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
            out[rank] = int(pid)
    return out


def test_a_stopped_rank_ends_the_job_at_the_timeout_and_is_named(tmp_path: Path) -> None:
    timeout = 5
    proc = subprocess.Popen(
        _command(tmp_path, "--steps", "1000000", "--timeout", str(timeout)),
        env=_env(),
        stderr=subprocess.PIPE,
    )
    err = StderrReader(proc)
    pids: dict[int, int] = {}
    try:
        err.wait_for(b"step 3/")
        pids = _rank_pids(proc.pid)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        proc.wait(timeout=timeout + 60)
        took = time.monotonic() - stopped
    finally:
        for pid in pids.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    text = err.text()
    assert proc.returncode != 0
    assert "rank 1 stopped responding" in text, text[-2000:]
    # The timeout plus heartbeat staleness and start-up noise of a loaded machine; the 30 s
    # SIGTERM grace torchrun would give a stopped process is not waited for.
    assert took < timeout + 15, took
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_sigterm_finishes_the_step_checkpoints_and_stops(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    proc = subprocess.Popen(
        _command(tmp_path, "--steps", "1000000", "--save", str(root)), env=_env(),
        stderr=subprocess.PIPE,
    )
    err = StderrReader(proc)
    try:
        err.wait_for(b"step 3/")
        proc.send_signal(signal.SIGTERM)  # torchrun passes it to every worker
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.text()
    match = re.search(r"stopped by SIGTERM after step (\d+); saved (\S+)", text)
    assert match, text[-2000:]
    manifest = checkpoint.verify(root)
    assert manifest["step"] == int(match.group(1)) >= 3
    assert Path(match.group(2)) == root / f"step-{manifest['step']:06d}"
