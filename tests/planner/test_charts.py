"""The planner's pictures (issue 42): memory per rank against the device's, and suggest's candidates
with their Pareto front; valid SVG whose bars and points are the planner's numbers."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from meshllm_dsl.checker import check_file
from meshllm_dsl.cli.main import main
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.views.charts import GIB, memory_svg, pareto_front, suggest_svg

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


def test_memory_bars_are_the_reports_bytes() -> None:
    plan = check_file(ROOT / "examples" / "llama2_70b_zbv.mesh").plans["zbv_64"]
    rep = analyze(plan)
    root = ET.fromstring(memory_svg(rep))
    titles = [r.find(f"{SVG}title").text for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(titles) >= len(rep.ranks) * 3  # weights, gradients, optimizer states at least, per rank
    weights = [t for t in titles if t.startswith("weights: ")]
    assert weights == [f"weights: {r.weight_bytes / GIB:.2f} GiB" for r in rep.ranks]
    assert "device memory" in "".join(root.itertext())


def test_pareto_front_keeps_what_nothing_beats() -> None:
    points = [(1.0, 5.0), (2.0, 3.0), (2.5, 4.0), (3.0, 1.0), (4.0, 1.0), (0.5, 9.0)]
    assert pareto_front(points) == [5, 0, 1, 3]


def test_suggest_draws_every_analysed_plan(tmp_path: Path) -> None:
    out = tmp_path / "suggest.svg"
    assert main(["suggest", str(ROOT / "examples" / "llama2_7b.mesh"), "--devices", "8", "--top", "2",
                 "--svg", str(out)]) == 0
    root = ET.fromstring(out.read_text())
    circles = list(root.iter(f"{SVG}circle"))
    assert len([c for c in circles if c.find(f"{SVG}title") is not None]) > 10
    assert "#1" in "".join(root.itertext()) and "Pareto front" in "".join(root.itertext())


def test_suggest_svg_marks_the_limit() -> None:
    text = suggest_svg([("a", 2.0, 10 * GIB), ("b", 1.0, 20 * GIB)], ["b"], 30 * GIB, "t")
    root = ET.fromstring(text)
    assert "fits left of here" in "".join(root.itertext())


def test_plan_svg_writes_the_memory_chart(tmp_path: Path) -> None:
    assert main(["plan", str(ROOT / "examples" / "tiny_llama_zbv.mesh"), "--svg", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"train_mesh.svg", "train_schedule.svg", "train_memory.svg"}
    ET.fromstring((tmp_path / "train_memory.svg").read_text())
