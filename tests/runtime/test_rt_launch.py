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

import pytest
import torch
from processes import StderrReader, run_module
from rt_models import llama_model, split_stages, vocab_loss

import meshllm_dsl.runtime as rt
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool
from meshllm_dsl.runtime.model.reference import build_reference
from meshllm_dsl.runtime.train import checkpoint, launch

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
    _python, _m, module, *rest = _command(tmp_path, *args, fail=fail, restarts=restarts)
    return run_module(module, *rest, env=_env(TEST_FAULT=fault, **share), timeout=180)


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


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One uninterrupted run that two tests read: 6 steps on a text file, a checkpoint every 2.
    (The directory holding the corpus, the run's output.)"""
    tmp = tmp_path_factory.mktemp("straight")
    (tmp / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    proc = _torchrun(tmp, "--steps", "6", *_data(tmp), "--save", str(tmp / "ckpt"), "--save-every", "2")
    return tmp, proc


def _data(tmp: Path) -> tuple[str, str]:
    return "--data", str(tmp / "corpus.txt")


def test_train_and_save_then_decode_from_the_checkpoint(
    straight: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path, pool: WorkerPool
) -> None:
    tmp, proc = straight
    ckpt = tmp / "ckpt"
    assert proc.returncode == 0, proc.stderr
    assert "step 6/6" in proc.stderr
    summary = [line for line in proc.stderr.splitlines() if line.startswith("done: loss")]
    assert len(summary) == 1, proc.stderr
    assert "tokens/s" in summary[0] and "r0=" in summary[0] and "r1=" in summary[0]
    for got, want in pool.run(_infer_job, 2, str(ckpt)):
        assert got == want
    # What --load read is said once, naming the step directory and the layout it was saved on.
    proc = _torchrun(tmp_path, "--infer", "--load", str(ckpt), "--tokens", "2")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("loaded the weights of ")]
    assert said == [f"loaded the weights of {ckpt / 'step-000006'} (step 6, saved on pipeline 2 x tensor 1)"], proc.stderr


def test_a_failing_rank_stops_the_job_promptly_and_names_the_cause(tmp_path: Path) -> None:
    timeout = 600
    start = time.monotonic()
    proc = _torchrun(tmp_path, "--steps", "5", "--timeout", str(timeout), fail=True)
    assert proc.returncode != 0
    assert "rank 1 failed: RuntimeError: injected failure in the loss" in proc.stderr
    # Rank 0 usually also says "rank 0 stopped: a peer rank exited", but torchrun may SIGTERM it
    # before it prints (seen once in a full-suite run), so only the cause is required.
    # Promptly: long before the collective timeout (10-20 s idle; 91 s once at load 75 beside
    # another test worker, so no tighter bound than this).
    assert time.monotonic() - start < timeout / 4


def _shards(step_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step_dir.glob("*.distcp"))}


def test_kill_9_during_a_save_keeps_the_previous_checkpoint_and_resume_is_exact(
    straight: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    # `straight`'s training (the same data) with faults: it must end in the same bytes.
    shared, proc = straight
    straight_root, crash = shared / "ckpt", tmp_path / "crash"
    assert proc.returncode == 0, proc.stderr
    want_loss = [ln for ln in proc.stderr.splitlines() if ln.startswith("done: loss")][0][:16]

    proc = _torchrun(
        tmp_path, "--steps", "6", *_data(shared), "--save", str(crash), "--save-every", "2",
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
    assert _shards(crash / "step-000002") == _shards(straight_root / "step-000002")

    proc = _torchrun(
        tmp_path, "--steps", "6", *_data(shared), "--resume", "latest", "--save", str(crash), "--save-every", "2"
    )
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {crash / 'step-000002'} at step 2" in proc.stderr
    assert "step 6/6" in proc.stderr and "step 2/6" not in proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("done: loss")][0][:16] == want_loss
    # 2 steps + crash + resume + 4 steps == 6 steps, bit for bit.
    assert _shards(crash / "step-000006") == _shards(straight_root / "step-000006")
    assert not list(crash.glob(".tmp-*"))

    # With torchrun's restarts a killed rank costs the steps since the last checkpoint, no more.
    restart = tmp_path / "restart"
    proc = _torchrun(
        tmp_path, "--steps", "6", *_data(shared), "--save", str(restart), "--save-every", "2",
        fault="kill -9 rank 1 at step 5, first attempt only", restarts=1,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {restart / 'step-000004'} at step 4" in proc.stderr
    assert _shards(restart / "step-000006") == _shards(straight_root / "step-000006")


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
        env=_env(MESHLLM_LOG_EVERY="1"),  # a progress line every step (not a terminal)
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
        _command(tmp_path, "--steps", "1000000", "--save", str(root)), env=_env(MESHLLM_LOG_EVERY="1"),
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


# ---------------------------------------------------------------- reports, start-up line, --profile steps


def test_a_failure_raised_from_none_is_reported_by_its_own_message(capfd: Any) -> None:
    """`raise X from None` is the project saying what went wrong: the report must not dig out the
    exception it replaced (``--prompt-ids 1,,x`` used to print int()'s "invalid literal")."""
    def failing() -> None:
        try:
            int("x")
        except ValueError:
            raise RuntimeError("--prompt-ids '1,,x': expected token ids") from None

    with contextlib.suppress(RuntimeError):
        failing()
    try:
        failing()
    except RuntimeError as exc:
        launch._report(exc, 0, 1, True, False, None)
    err = capfd.readouterr().err
    assert err.strip() == "error: rank 0 failed: RuntimeError: --prompt-ids '1,,x': expected token ids", err
    # Without `from None` the innermost cause is still the one reported (pipelining's wrappers).
    try:
        try:
            int("x")
        except ValueError as inner:
            raise RuntimeError("[Stage 0] failed to run forward") from inner
    except RuntimeError as exc:
        launch._report(exc, 0, 1, True, False, None)
    assert "invalid literal for int()" in capfd.readouterr().err


def test_a_bad_prompt_from_a_rank_is_said_once_as_an_input_error(capfd: Any) -> None:
    from meshllm_dsl.runtime.train.tokens import DataError, parse_ids

    try:
        parse_ids("1,,x", 64)
    except DataError as exc:
        launch._report(exc, 3, 4, False, False, None)  # not the first rank: silent
        launch._report(exc, 0, 4, True, False, None)
    assert capfd.readouterr().err.strip() == (
        "error: --prompt-ids '1,,x': item 2 is empty, expected comma-separated token ids, e.g. 1,2,3")


def _relay_output(chunks: list[bytes], tty: bool) -> bytes:
    """What `meshc run`'s relay writes for the job output ``chunks`` (a pipe, read to its end)."""
    import io

    from meshllm_dsl.cli import job as cli_job
    from meshllm_dsl.runtime.train.startup import StartupLine

    read_fd, write_fd = os.pipe()
    relay = cli_job._Relay(read_fd, debug=False, tty=tty)
    out = io.BytesIO()
    clock = iter(range(100))
    relay.startup = StartupLine(tty, clock=lambda: float(next(clock)), tick=0, out=out)
    for chunk in chunks:
        os.write(write_fd, chunk)
    os.close(write_fd)
    relay.run()
    os.close(read_fd)
    return out.getvalue()


def _marker(rank: int, phase: str) -> bytes:
    return f"meshllm-startup {rank} 2 {phase} 1.0\n".encode()


START = [_marker(0, "up"), _marker(1, "up"), _marker(1, "joined"), _marker(0, "joined"),
         b"warning: something a rank says early\n", _marker(0, "built"), _marker(1, "built")]
BAR = [b"\r[####....] step 1/2  loss 5.0", b"\r[########] step 2/2  loss 4.0\n", b"done: loss 4.0\n"]


def test_the_start_up_line_on_a_terminal() -> None:
    out = _relay_output(START + BAR, tty=True)
    lines = out.split(b"\r\x1b[K")
    shown = [x for x in lines if x.startswith(b"starting")]
    assert shown[0] == b"starting (1 s): torchrun is starting the ranks (each imports torch)"
    assert b"starting (2 s): 1/2 ranks up (importing torch)" in shown
    assert b"starting (4 s): 2/2 ranks up, 1/2 joined the process group" in shown
    assert b"starting (7 s): 2/2 ranks in the process group, 1/2 built their stages" in shown
    assert shown[-1] == b"starting (8 s): 2/2 ranks ready, first step"
    # Other output erases the line, then it is drawn again; the bar erases it for good.
    assert b"\r\x1b[Kwarning: something a rank says early\n\r\x1b[Kstarting" in out
    assert out.endswith(b"\r\x1b[K\r[####....] step 1/2  loss 5.0\r[########] step 2/2  loss 4.0\ndone: loss 4.0\n")
    assert b"meshllm-startup" not in out


def test_the_start_up_line_is_quiet_when_stderr_is_not_a_terminal() -> None:
    out = _relay_output(START + BAR, tty=False)
    assert out == b"warning: something a rank says early\n" + b"".join(BAR)


def test_ranks_mark_their_start_up_only_under_meshc_run(capfd: Any, monkeypatch: Any) -> None:
    from meshllm_dsl.runtime.train import startup

    monkeypatch.delenv(startup.ENV, raising=False)
    startup.report("up")
    assert capfd.readouterr().err == ""
    monkeypatch.setenv(startup.ENV, "1")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    startup.report("joined")
    got = startup.parse(capfd.readouterr().err.encode().rstrip(b"\n"))
    assert got is not None and got[:3] == (3, 8, "joined")


def test_meshc_run_shows_the_start_up_line_on_a_terminal(tmp_path: Path) -> None:
    """A real `meshc run` (one rank) under a pseudo-terminal: the ranks' markers arrive and are drawn."""
    import pty

    spec = tmp_path / "one.mesh"
    spec.write_text("mesh one { axes data = 1 }\nmodel m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, "
                    "positions = 16 }\nplan train on one for m {\n    batch = 2\n    seq = 8\n}\n")
    pid, fd = pty.fork()
    if pid == 0:  # the child: meshc with the terminal as its stderr
        os.execv(sys.executable, [sys.executable, "-m", "meshllm_dsl", "run", str(spec), "--steps", "2"])
    import select

    out, deadline = b"", time.monotonic() + 300
    with contextlib.suppress(OSError):  # EIO once the child has exited
        while select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
    if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, out[-2000:]
    assert b"starting (" in out and b"1/1 ranks ready, first step" in out, out[-2000:]
    assert b"step 2/2" in out and b"meshllm-startup" not in out


def test_profile_steps_are_one_number_in_help_error_and_readme() -> None:
    """`--profile`'s extra steps come from runtime/train/profile_steps.py: `meshc run --help`, the
    generated module's --help, the error refusing --profile with --save and the README agree."""
    from meshllm_dsl.cli import main as cli
    from meshllm_dsl.runtime.train.profile_steps import (
        PROFILE_STEPS,
        PROFILE_STEPS_TEXT,
        PROFILE_TIMED,
        PROFILE_UNTIMED,
        TRACE_STEPS,
        TRACE_STEPS_TEXT,
    )

    assert PROFILE_STEPS == len(PROFILE_UNTIMED) + PROFILE_TIMED == 7

    def flat(text: str) -> str:  # argparse wraps lines, also after a hyphen
        return " ".join(re.sub(r"-\n\s*", "-", text).split())

    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        cli.main(["run", "--help"])
    assert f"measure {PROFILE_STEPS_TEXT} on every rank" in flat(buf.getvalue())
    assert TRACE_STEPS_TEXT in flat(buf.getvalue())
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        launch.parse_args(["--help"])
    assert f"after training, {PROFILE_STEPS_TEXT};" in flat(buf.getvalue())
    for flag, text in (("--profile", PROFILE_STEPS_TEXT), ("--profile-trace", TRACE_STEPS_TEXT)):
        try:
            launch.check_inputs(launch.parse_args([flag, "out", "--save", "ckpt"]))
        except launch.InputError as err:
            assert f"{flag} trains {text} after --steps" in str(err)
        else:
            raise AssertionError(f"{flag} with --save was accepted")
    assert "2 more steps (1 warm-up, then 1 under torch.profiler)" == TRACE_STEPS_TEXT and TRACE_STEPS == 2
    readme = flat((HERE.parents[1] / "README.md").read_text())
    assert (f"trains {PROFILE_STEPS} more steps after `--steps` (`runtime/train/profile_steps.py`): a warm-up, "
            f"a step measured for memory and one counting kernels (none of them timed: instrumentation slows "
            f"them 2-3x), then {PROFILE_TIMED} timed steps") in readme


def _started(cmd: list[str]) -> tuple[Any, int, str]:
    """`meshc run`'s launcher start for ``cmd``: (the process handle, its exit code, its stderr)."""
    from meshllm_dsl.cli import job as cli_job

    read_fd, write_fd = os.pipe()
    proc = cli_job._start(cmd, dict(os.environ), write_fd, close=read_fd)
    os.close(write_fd)
    out = b""
    while chunk := os.read(read_fd, 65536):
        out += chunk
    os.close(read_fd)
    while proc.poll() is None:
        time.sleep(0.01)
    return proc, proc.returncode, out.decode()


def test_torchrun_starts_in_a_fork_of_meshc_that_has_torch_and_keeps_its_exit_codes() -> None:
    """No second interpreter importing torch before the ranks start; torchrun's own exits (argparse
    usage errors, a failed job) still reach the relay as they would from `python -m`."""
    from meshllm_dsl.cli import job as cli_job

    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    proc, code, err = _started([*torchrun, "--standalone"])
    assert isinstance(proc, cli_job._Forked)
    assert code == 2 and "the following arguments are required: training_script" in err, err
    _, code, err = _started([*torchrun, "--standalone", "--nproc-per-node=1", "-m", "no_such_module_anywhere"])
    assert code == 1 and "No module named no_such_module_anywhere" in err, err
    # Anything else is a plain subprocess.
    proc, code, _ = _started([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert not isinstance(proc, cli_job._Forked) and code == 3
