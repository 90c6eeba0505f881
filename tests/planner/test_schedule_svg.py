"""The schedule picture runs torch's own action order, and its caption gives the planner's bubble."""

from __future__ import annotations

from html import escape

import pytest

from meshllm_dsl.checker import check_text
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.schedule import rank_order, schedule_cost
from meshllm_dsl.views.svg import schedule_svg, simulate

INTERLEAVED = """
mesh m { axes pipeline = 4 }
model l = llama { vocab = 256, hidden = 64, layers = 8, heads = 4, ffn = 128 }
plan p on m for l {
    batch = 8
    seq = 16
    microbatches = 8
    stages over pipeline virtual 2 balanced
    schedule interleaved_1f1b
}
"""


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 6, 2)])
def test_each_rank_runs_torchs_order(  # m = 6: where torch's warm-up is not Megatron's order
schedule: str, p: int, m: int, v: int) -> None:
    ops = simulate(schedule, p, m, v)
    for r in range(p):
        ran = [(o.kind, o.chunk * p + r, o.micro) for o in sorted((o for o in ops if o.rank == r), key=lambda o: o.start)]
        assert ran == [a for a in rank_order(schedule, p, v, m, r) if a is not None]
    span = max(o.end for o in ops)
    idle = 1 - sum(o.end - o.start for o in ops) / (span * p)
    assert idle == pytest.approx(schedule_cost(schedule, p, v, m).bubble)


def test_caption_gives_the_planners_bubble() -> None:
    result = check_text(INTERLEAVED, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    plan = result.plans["p"]
    bubble = analyze(plan).bubble
    svg = schedule_svg(plan)
    closed = 3 / (8 + 3) / 2  # 13.6 %
    assert abs(bubble - closed) > 0.01  # torch's order is not the closed form's
    assert escape(f"bubble in torch's interleaved_1f1b order (backward = 2 x forward): {bubble:.1%}") in svg
    assert f"the closed form (p - 1) / (m + p - 1) / v gives {closed:.1%}" in svg
