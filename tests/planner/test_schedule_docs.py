"""docs/pipeline-schedules.md's table is the planner's own: Llama 2 70B on 8 pipeline x 8 tensor
H100s (examples/llama2_70b_zbv.mesh) under every schedule, rendered again here and compared, so the
page cannot drift from the code (`pytest tests/planner --update-goldens` rewrites it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm_dsl.checker import check_text
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.formatting import fmt_bytes, fmt_seconds

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "llama2_70b_zbv.mesh"
DOC = ROOT / "docs" / "pipeline-schedules.md"
BEGIN, END = "<!-- schedule table: tests/planner/test_schedule_docs.py -->", "<!-- end of schedule table -->"

# (schedule, stages per rank) as the table lists them
ROWS = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("interleaved_zb", 1), ("zbv", 2),
        ("dualpipev", 2))


def schedule_table() -> str:
    text = EXAMPLE.read_text()
    rows = ["| schedule | stages per rank | bubble | bubble time | step | tokens/s | activations held (rank 0) | peak memory |",
            "|---|---|---|---|---|---|---|---|"]
    for schedule, virtual in ROWS:
        spec = text.replace("schedule zbv", f"schedule {schedule}").replace(
            "stages over pipeline virtual 2", "stages over pipeline" + (" virtual 2" if virtual == 2 else ""))
        result = check_text(spec, str(EXAMPLE))
        assert result.ok, [d.message for d in result.errors]
        rep = analyze(result.plans["zbv_64"])
        rank0 = next(r for r in rep.ranks if r.coord == 0)
        tokens = rep.plan.batch * rep.plan.seq / rep.step.total_s
        rows.append(f"| `{schedule}` | {virtual} | {rep.bubble:.1%} | {fmt_seconds(rep.step.bubble_s)} | "
                    f"{fmt_seconds(rep.step.total_s)} | {tokens:,.0f} | {rank0.in_flight} microbatch-stages | "
                    f"{fmt_bytes(rep.peak_training_bytes)} |")
    return "\n".join(rows)


def test_the_docs_table_is_the_planners(request: pytest.FixtureRequest) -> None:
    table = schedule_table()
    doc = DOC.read_text()
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    want = f"{head}{BEGIN}\n{table}\n{END}{tail}"
    if request.config.getoption("--update-goldens"):
        DOC.write_text(want)
        doc = want
    assert doc == want, "run pytest tests/planner/test_schedule_docs.py --update-goldens"


def test_the_readme_quotes_the_same_numbers() -> None:
    """README.md's short table repeats five rows of the page's: bubble, step and peak as computed."""
    readme = (ROOT / "README.md").read_text()
    checked = 0
    for row in schedule_table().splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        name, bubble, step, peak = cells[0], cells[2], cells[4], cells[7]
        quoted = [line for line in readme.splitlines() if line.startswith(f"| {name} ")]
        for line in quoted:
            assert [c.strip() for c in line.strip("|").split("|")][1:] == [bubble, step, peak], line
            checked += 1
    assert checked == 5


def test_the_readmes_plan_output_is_meshcs() -> None:
    """The README quotes `meshc plan examples/llama2_70b.mesh`'s opening lines: they must be what it prints."""
    import contextlib
    import io

    from meshllm_dsl.cli.main import main

    readme = (ROOT / "README.md").read_text()
    quoted = readme.split("$ meshc plan examples/llama2_70b.mesh\n", 1)[1].split("```", 1)[0].rstrip("\n").splitlines()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(ROOT / "examples" / "llama2_70b.mesh")]) == 0
    assert out.getvalue().splitlines()[: len(quoted)] == quoted
