"""`meshc report FILE.jsonl`: the loss and tokens/s per step of a `meshc run --metrics` file as SVG;
a bad line is one error naming file:line (exit 2), never a traceback."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from meshllm_dsl.cli.main import main
from meshllm_dsl.views.metrics_report import read_metrics, series


def _row(step: int, loss: float | None = 5.0, tok: float | None = 100.0) -> str:
    return json.dumps({"step": step, "loss": loss, "tokens_per_s": tok, "lr": 1e-3, "grad_norm": 1.0,
                       "peak_memory_bytes": {"0": 1}, "peak_memory_kind": "cpu_max_rss"})


def _write(tmp_path: Path, lines: list[str], end: str = "\n") -> Path:
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(lines) + end)
    return path


def test_report_draws_loss_and_tokens_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, [_row(s, 5.0 - s / 10, 100.0 + s) for s in range(1, 8)])
    out = tmp_path / "charts"
    assert main(["report", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "run.loss.svg"), str(out / "run.tokens_per_s.svg")]
    for name, title in (("run.loss.svg", "loss per step"), ("run.tokens_per_s.svg", "tokens/s per step")):
        root = ET.fromstring((out / name).read_text())
        ns = "{http://www.w3.org/2000/svg}"
        assert any(t.text == title for t in root.iter(f"{ns}text"))
        (line,) = [p for p in root.iter(f"{ns}path")]
        assert line.get("d", "").count("L") == 6  # 7 steps
    # Without --out: beside the file.
    assert main(["report", str(path)]) == 0
    assert (tmp_path / "run.loss.svg").is_file()


@pytest.mark.parametrize(("lines", "end", "says"), [
    ([_row(1), "{not json", _row(3)], "\n", "run.jsonl:2: not JSON"),
    ([_row(1), "[1, 2]"], "\n", "run.jsonl:2: expected a JSON object per line, got list"),
    ([_row(1), json.dumps({"step": "2", "loss": 1, "tokens_per_s": 1})], "\n", "run.jsonl:2: `step` must be a non-negative integer"),
    ([json.dumps({"step": 1, "tokens_per_s": 1})], "\n", "run.jsonl:1: no `loss`"),
    ([json.dumps({"step": 1, "loss": "x", "tokens_per_s": 1})], "\n", "run.jsonl:1: `loss` must be a number or null"),
    ([], "", "run.jsonl: no steps"),
], ids=["not-json", "not-object", "step-text", "no-loss", "loss-text", "empty"])
def test_a_bad_line_names_file_and_line(tmp_path: Path, lines: list[str], end: str, says: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, lines, end)
    assert main(["report", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshc: error: ") and says in err, err
    assert not (tmp_path / "o").exists()


def test_a_run_killed_mid_line_and_a_resumed_run(tmp_path: Path) -> None:
    # The last line cut off (no newline) is left out; a resumed run's repeated steps keep the last value.
    path = _write(tmp_path, [_row(1, 4.0), _row(2, 3.0), _row(2, 2.5), _row(3, None), '{"step": 4, "lo'], end="")
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 2, 3]
    assert series(rows, "loss") == [(1, 4.0), (2, 2.5)]


def test_report_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    path = _write(tmp_path, [_row(1)])
    (tmp_path / "afile").write_text("x")
    assert main(["report", str(path), "--out", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is not a directory" in err, err
