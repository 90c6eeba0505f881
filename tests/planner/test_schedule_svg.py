"""The schedule picture runs torch's own action order, and its caption gives the planner's bubble."""

from __future__ import annotations

from html import escape

import attrs
import pytest

from meshllm_dsl.checker import check_text
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.schedule import COST, rank_order, schedule_cost
from meshllm_dsl.views.svg import KIND_NAMES, schedule_svg, simulate

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


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 6, 2),
                                                   ("zbv", 4, 8, 2), ("dualpipev", 4, 8, 2), ("interleaved_zb", 4, 8, 1), ("looped_bfs", 3, 6, 2)])
def test_each_rank_runs_torchs_order(  # m = 6: where torch's warm-up is not Megatron's order
schedule: str, p: int, m: int, v: int) -> None:
    ops = simulate(schedule, p, m, v)
    for r in range(p):
        ran = [(o.kind, o.stage, o.micro) for o in sorted((o for o in ops if o.rank == r), key=lambda o: o.start)]
        assert all(o.chunk == o.stage // p for o in ops)
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


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_split_backward_picture(schedule: str) -> None:
    # The checker may not take these schedules yet: the interleaved plan, told to run them (v = 2).
    result = check_text(INTERLEAVED, "t.mesh")
    plan = attrs.evolve(result.plans["p"], schedule=schedule)
    ops = simulate(schedule, 4, 8, 2)
    assert {o.kind for o in ops} >= {"F", "I", "W"}
    assert all(o.end - o.start == COST[o.kind] for o in ops)  # each box as wide as its cost
    cost = schedule_cost(schedule, 4, 2, 8)
    for r in range(4):  # at its simulated start
        mine = sorted((o.start, (o.kind, o.stage, o.micro)) for o in ops if o.rank == r)
        assert mine == sorted(zip(cost.starts[r], cost.orders[r]))
    svg = schedule_svg(plan)
    for kind in ("F", "I", "W", "B"):
        assert escape(KIND_NAMES[kind]) in svg
    assert "idle (the bubble)" in svg
    assert f"bubble in torch&#x27;s {schedule} order" in svg and f"{cost.bubble:.1%}" in svg
    assert svg.count("<rect") >= len(ops)
