"""What `meshc run` writes for a user: plain progress lines when its stderr is not a terminal (no
carriage returns), and `--metrics FILE.jsonl`, one whole JSON line per step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from meshllm_dsl.cli import job as cli_job  # noqa: E402
from meshllm_dsl.cli import main as cli  # noqa: E402
from meshllm_dsl.runtime.train import launch  # noqa: E402

SPEC = """
mesh two { axes tensor = 2 }
model m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, positions = 16 }
plan train on two for m {
    batch = 2
    seq = 8
    layout { heads -> tensor, ffn -> tensor, vocab -> tensor }
}
"""

MOE_SPEC = """
mesh two { axes data = 2 }
model m = mixtral { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 48, experts = 4, top_k = 2 }
plan train on two for m {
    batch = 2
    seq = 8
    layout { batch -> data }
}
"""


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "tp.mesh"
    path.write_text(SPEC)
    return path


def test_a_redirected_run_prints_plain_lines_and_writes_metrics(
    spec: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(launch.TTY_ENV, raising=False)
    metrics = tmp_path / "m.jsonl"
    assert cli.main(["run", str(spec), "--steps", "5", "--timeout", "120", "--metrics", str(metrics)]) == 0
    err = capfd.readouterr().err
    assert "\r" not in err, repr(err)
    assert "step 5/5" in err and "done: loss" in err, err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and r["lr"] > 0 and r["grad_norm"] > 0
        assert set(r["peak_memory_bytes"]) == {"0", "1"} and r["peak_memory_kind"] == "cpu_max_rss"
        assert all(v > 2**20 for v in r["peak_memory_bytes"].values())
        assert "expert_load" not in r
    # An existing file is refused (a usage error, before any rank starts) unless --resume appends.
    monkeypatch.setattr(cli_job, "run_job", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli.main(["run", str(spec), "--steps", "5", "--metrics", str(metrics)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "the file exists (pass --resume to append to it" in err, err


def test_moe_metrics_carry_the_expert_load(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "moe.mesh"
    spec.write_text(MOE_SPEC)
    metrics = tmp_path / "m.jsonl"
    assert cli.main(["run", str(spec), "--steps", "2", "--timeout", "120", "--metrics", str(metrics)]) == 0, \
        capfd.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 2
    load = rows[0]["expert_load"]
    assert load["rank"] == 0 and len(load["layers"]) == 2
    for layer in load["layers"]:
        # Rank 0's tokens (batch 2 over data 2: 1 x 8), top 2 of 4 experts each.
        assert len(layer["tokens_per_expert"]) == 4 and sum(layer["tokens_per_expert"]) == 16


@pytest.mark.parametrize(("flags", "expected"), [
    (["--metrics", "{t}/nodir/m.jsonl"], "--metrics {t}/nodir/m.jsonl: no such directory {t}/nodir"),
    (["--metrics", "{t}"], "--metrics {t}: is a directory"),
    (["--infer", "--metrics", "{t}/m.jsonl"], "--metrics records training steps"),
])
def test_bad_metrics_paths_are_usage_errors(
    flags: list[str], expected: str, spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli_job, "run_job", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli.main(["run", str(spec), *[f.format(t=tmp_path) for f in flags]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected.format(t=tmp_path) in err, err


def _lines(steps: int, start: int = 0, capsys: Any = None) -> list[str]:
    log = launch._ProgressLog(start, steps, tty=False)
    for done in range(start + 1, steps + 1):
        log.step(done, 1.0, 10.0)
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("steps", [1, 5, 19, 20, 21, 100, 1000, 123457])
def test_plain_progress_prints_about_twenty_lines_and_the_last_step(steps: int, capsys: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launch.LOG_EVERY_ENV, raising=False)
    lines = _lines(steps, capsys=capsys)
    assert 1 <= len(lines) <= min(steps, 22)
    assert steps < 10 or len(lines) >= 10
    assert lines[0].startswith("step 1/") and lines[-1].startswith(f"step {steps}/{steps} ")
    assert not any("\r" in line for line in lines)


def test_plain_progress_after_a_resume_counts_from_the_resumed_step(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launch.LOG_EVERY_ENV, raising=False)
    lines = _lines(100, start=60, capsys=capsys)
    assert lines[0].startswith("step 61/100") and lines[-1].startswith("step 100/100")
    assert 10 <= len(lines) <= 22
    monkeypatch.setenv(launch.LOG_EVERY_ENV, "1")
    assert len(_lines(100, start=60, capsys=capsys)) == 40


def test_tensorboard_without_the_package_names_what_to_install(
    spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorboard is installed")
    monkeypatch.setattr(cli_job, "run_job", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli.main(["run", str(spec), "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert err == "meshc: error: --tensorboard needs the tensorboard package: pip install tensorboard\n", err


def test_the_bar_on_a_terminal_and_who_decides(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    log = launch._ProgressLog(0, 2, tty=True)
    log.step(1, 5.0, 10.0)
    log.step(2, 4.0, 10.0)
    err = capsys.readouterr().err
    assert err.startswith("\r[") and err.count("\r") == 2 and err.endswith("step 2/2  loss 4.0000  10 tok/s\n")
    # `meshc run` says whether its stderr is a terminal; a rank started by hand asks its own stderr.
    monkeypatch.setenv(launch.TTY_ENV, "1")
    assert launch.progress_on_terminal()
    monkeypatch.setenv(launch.TTY_ENV, "0")
    assert not launch.progress_on_terminal()
    monkeypatch.delenv(launch.TTY_ENV)
    assert not launch.progress_on_terminal()  # pytest's captured stderr is no terminal
