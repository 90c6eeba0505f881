"""`meshc run` as a user drives it: bad inputs refused before any rank starts, interrupts stop the
whole job (no process or temporary directory left behind)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from processes import StderrReader

pytest.importorskip("torch")

from meshllm_dsl.cli import job as cli_job  # noqa: E402
from meshllm_dsl.cli import main as cli  # noqa: E402

SPEC = """
mesh two { axes pipeline = 2 }
model m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, positions = 16 }
plan train on two for m {
    batch = 4
    seq = 8
    microbatches = 2
    stages over pipeline balanced
    schedule gpipe
}
"""


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "two.mesh"
    path.write_text(SPEC)
    return path


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "short.txt").write_bytes(b"abc")
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("mine")
    (tmp / "partial").mkdir()
    (tmp / "partial" / ".metadata").write_bytes(b"x")
    return {
        "missing data": (["--data", str(tmp / "nope.txt")], "--data {t}/nope.txt: no such file"),
        "empty data": (["--data", str(tmp / "empty.txt")], "--data {t}/empty.txt: the file is empty"),
        "short data": (["--data", str(tmp / "short.txt")], "needs at least 10 bytes for seq 8, has 3"),
        "steps 0": (["--steps", "0"], "--steps must be at least 1 (0 only with --weights / --load / --export-hf), got 0"),
        "steps -1": (["--steps", "-1"], "--steps must be at least 1 (0 only with --weights / --load / --export-hf), got -1"),
        "eval without data": (["--eval"], "--eval needs --data FILE"),
        "prompt without tokenizer": (["--infer", "--prompt", "hi"], "--prompt TEXT needs --tokenizer DIR"),
        "weights missing": (["--weights", str(tmp / "nope")], "--weights"),
        "tokens -3": (["--infer", "--tokens", "-3"], "--tokens must be at least 1, got -3"),
        "timeout 0": (["--timeout", "0"], "--timeout must be positive"),
        "resume missing": (["--resume", str(tmp / "nope")], "--resume: checkpoint {t}/nope: no such directory"),
        "resume partial": (["--resume", str(tmp / "partial")], "no manifest.json: an incomplete save"),
        "resume latest without save": (["--resume", "latest"], "--resume latest needs --save DIR"),
        "load foreign": (["--load", str(tmp / "foreign")], "not a meshllm checkpoint"),
        "save over other files": (["--save", str(tmp / "foreign")], "holds files that are not meshllm checkpoints (notes.txt)"),
        "save onto a file": (["--save", str(tmp / "empty.txt")], "exists and is not a directory"),
        "save-every without save": (["--save-every", "5"], "--save-every needs --save DIR"),
        "trace with steps 0": (["--steps", "0", "--export-hf", str(tmp / "hf"), "--profile-trace", str(tmp / "t")],
                               "--profile-trace trains 2 more steps (1 warm-up, then 1 under torch.profiler) after --steps"),
        "trace with save": (["--save", str(tmp / "ck"), "--profile-trace", str(tmp / "t")],
                            "--profile-trace trains 2 more steps"),
        "trace onto a file": (["--profile-trace", str(tmp / "empty.txt")],
                              "--profile-trace {t}/empty.txt: exists and is not a directory"),
    }


CASES = [
    "missing data", "empty data", "short data", "steps 0", "steps -1", "tokens -3", "timeout 0",
    "resume missing", "resume partial", "resume latest without save", "load foreign",
    "save over other files", "save onto a file", "save-every without save", "eval without data",
    "prompt without tokenizer", "weights missing", "trace with steps 0", "trace with save", "trace onto a file",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_inputs_fail_with_one_line_before_any_rank_starts(
    case: str, spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_launch(*args: object, **kwargs: object) -> int:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(cli_job, "run_job", no_launch)
    flags, expected = _bad_inputs(tmp_path)[case]
    assert cli.main(["run", str(spec), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshc: error: "), err
    assert expected.format(t=tmp_path) in err, err


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            todo += [c for c in children if c not in out]
            out.update(children)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupting_meshc_stops_the_whole_job(spec: Path, signum: int, code: int) -> None:
    # A line every step: a redirected run of a million steps would print one every 50,000.
    env = dict(os.environ, OMP_NUM_THREADS="1", MESHLLM_LOG_EVERY="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshllm_dsl", "run", str(spec), "--steps", "1000000"],
        env=env, stderr=subprocess.PIPE,
    )
    err = StderrReader(proc)
    job: set[int] = set()
    try:
        err.wait_for(b"step 3/")
        job = _descendants(proc.pid)
        workdir = re.search(rb"/[^ \0]*meshc-run-[^/ \0]+", b" ".join(
            Path(f"/proc/{p}/cmdline").read_bytes() for p in job if Path(f"/proc/{p}").exists()
        ))
        assert workdir, "no meshc-run directory in the job's command lines"
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == code
    finally:
        for pid in job | {proc.pid}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    text = err.text()
    assert not [p for p in job if _alive(p)], "job processes outlived meshc"
    assert not Path(workdir.group().decode()).exists()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-2000:]
    assert "meshc: interrupted; stopping the job" in text


TENSOR_SPEC = """
mesh two { axes tensor = 2 }
model m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, positions = 16 }
plan train on two for m {
    batch = 2
    seq = 8
    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }
}
"""


def test_profile_trace_writes_a_chrome_trace_per_rank_with_the_collectives(tmp_path: Path) -> None:
    import json

    spec = tmp_path / "tp.mesh"
    spec.write_text(TENSOR_SPEC)
    out = tmp_path / "trace"
    proc = subprocess.run(
        [sys.executable, "-m", "meshllm_dsl", "run", str(spec), "--steps", "1", "--timeout", "120",
         "--profile-trace", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{out}/rank*.json" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json"]  # no partial file left
    for rank in range(2):
        events = json.loads((out / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        # The row-parallel layers' all-reduces (forward and backward) as gloo ran them.
        assert "gloo:all_reduce" in names, sorted(n for n in names if n and "gloo" in n)
        assert any("aten::mm" in str(n) or "aten::addmm" in str(n) for n in names)
        # record_shapes: operators carry their input shapes.
        assert any("Input Dims" in e.get("args", {}) for e in events)
