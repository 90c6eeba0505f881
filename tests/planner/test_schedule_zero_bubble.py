"""The multi-stage schedules torch 2.13 adds to interleaved 1F1B (looped BFS, interleaved zero bubble,
ZBV, DualPipeV): meshllm_dsl.planner.schedule's orders against torch's own pipeline_order (torch's
classes built over stand-in stages, no process group), and the simulated bubble and held
activations against the DeepSeek-V3 report's Table 2 with F = I = W = 1, B = I + W = 2."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from meshllm_dsl.ir import placement_of, stage_coord
from meshllm_dsl.planner.schedule import (
    COST,
    overlapped_pairs,
    rank_order,
    schedule_cost,
    simulate,
    stages_per_rank,
)

MULTI = ("looped_bfs", "interleaved_zb", "zbv", "dualpipev")


def _allowed(schedule: str, p: int, m: int) -> bool:
    """The microbatch counts torch accepts (measured)."""
    if schedule == "dualpipev":
        return m >= 2 * p
    if schedule == "interleaved_zb":
        return m % max(1, m // p) == 0
    return m >= 1


def _grid() -> list[tuple[str, int, int, int]]:
    out = []
    for schedule in MULTI:
        vs = (1, 2, 3) if schedule in ("looped_bfs", "interleaved_zb") else (2,)
        for p, v, m in itertools.product((2, 3, 4), vs, range(1, 17)):
            if _allowed(schedule, p, m):
                out.append((schedule, p, v, m))
        for m in (1, 8, 15, 16, 24):  # a few at p = 8
            if _allowed(schedule, 8, m):
                out.append((schedule, 8, vs[-1], m))
    return out


def _torch_orders(schedule: str, p: int, v: int, m: int) -> dict[int, list[Any]]:
    torch = pytest.importorskip("torch")
    sch = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {"looped_bfs": sch.ScheduleLoopedBFS, "interleaved_zb": sch.ScheduleInterleavedZeroBubble,
           "zbv": sch.ScheduleZBVZeroBubble, "dualpipev": sch.ScheduleDualPipeV}[schedule]

    class FakeStage:  # what the classes' constructors read of a stage
        def __init__(self, idx: int, n: int) -> None:
            self.stage_index, self.num_stages, self.group_size, self.group_rank = idx, n, p, 0
            self.submod = torch.nn.Linear(1, 1)
            self.is_first, self.is_last = idx == 0, idx == n - 1
            self.stage_index_to_group_rank: dict[int, int] = {}

        def has_backward(self) -> bool:
            return True

    n = p * v
    stages = [FakeStage(i, n) for i in range(n) if stage_coord(i, p, placement_of(schedule)) == 0]
    order = cls(stages, n_microbatches=m, loss_fn=lambda a, b: a).pipeline_order

    def plain(a: Any) -> list[Any]:
        if a is None:
            return [None]
        if a.computation_type == sch.OVERLAP_F_B:  # DualPipeV's pair: its forward, then its backward
            return [x for sub in a.sub_actions for x in plain(sub)]
        return [(a.computation_type.value, a.stage_index, a.microbatch_index)]

    return {r: [x for a in order[r] for x in plain(a)] for r in range(p)}


@pytest.mark.parametrize(("schedule", "p", "v", "m"), _grid())
def test_order_is_torchs_pipeline_order(schedule: str, p: int, v: int, m: int) -> None:
    theirs = _torch_orders(schedule, p, v, m)
    for r in range(p):
        assert rank_order(schedule, p, v, m, r) == theirs[r]  # idle slots (None) included
    cost = schedule_cost(schedule, p, v, m)  # and it runs: no deadlock, every stage on its rank
    for r, order in enumerate(cost.orders):
        assert {stage_coord(s, p, placement_of(schedule)) for _, s, _ in order} == {r}
        assert len(order) == m * stages_per_rank(schedule, v) * (2 if schedule == "looped_bfs" else 3) - (
            sum(a[0] == "B" for a in order) if schedule == "dualpipev" else 0)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zbv_with_few_microbatches_names_none_beyond_m(p: int) -> None:
    # torch builds ZBV for max(2p - 1, m) microbatches and blanks (None) the actions of those >= m.
    for m in range(1, 2 * p - 1):
        for r in range(p):
            order = rank_order("zbv", p, 2, m, r)
            assert all(a[2] < m for a in order if a is not None)
            assert sorted(a for a in order if a is not None) == sorted(
                (k, s, j) for k in "FIW" for s in (r, 2 * p - 1 - r) for j in range(m))


def _idle(schedule: str, p: int, m: int, v: int = 1) -> float:
    cost = schedule_cost(schedule, p, v, m)
    assert cost.busy == m * stages_per_rank(schedule, v) * (COST["F"] + COST["I"] + COST["W"])
    return cost.makespan - cost.busy


F, B, W = COST["F"], COST["B"], COST["W"]
SHAPES = [(p, m) for p in (2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p)]


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_idle_per_rank_is_deepseek_v3_table_2(p: int, m: int) -> None:
    assert _idle("1f1b", p, m) == (p - 1) * (F + B)
    if m % max(1, m // p) == 0:  # torch's ZB1P needs whole rounds
        assert _idle("interleaved_zb", p, m) == (p - 1) * (F + B - 2 * W)  # ZB1P
    # DualPipeV: p ranks, 2p stages; F&B = F + B (the pair's compute is their sum) and the pair
    # starts when both its inputs are there, as torch receives them before it runs the pair.
    assert _idle("dualpipev", p, m, 2) == (p - 1) * ((F + B) + B - 3 * W)


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_idle_of_the_others(p: int, m: int) -> None:
    # Measured, no table row: ZBV reaches ZB1P's p - 1 (the last rank's first input is p - 1
    # forwards away, a floor for any order here) once m >= 2p - 1; looped BFS is GPipe's 3(p - 1)
    # whatever v; interleaved ZB with v = 2 is p - 1 too.
    assert _idle("zbv", p, m, 2) == p - 1
    for v in (1, 2, 3):
        assert _idle("looped_bfs", p, m, v) == 3 * (p - 1)
    if m % max(1, m // p) == 0:
        assert _idle("interleaved_zb", p, m, 2) == p - 1


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_idle_with_few_microbatches(p: int) -> None:
    # Measured: ZBV's blanked microbatches (m < 2p - 1) idle 2 units each beyond the floor; looped
    # BFS with m < p waits 3 units per missing microbatch on each extra loop.
    for m in range(1, 2 * p + 1):
        assert _idle("zbv", p, m, 2) == max(p - 1, 2 * (2 * p - 1 - m))
        for v in (1, 2, 3):
            assert _idle("looped_bfs", p, m, v) == 3 * (p - 1) + 3 * (v - 1) * max(0, p - m)


def _peak(order: tuple[tuple[str, int, int], ...], p: int, v: int) -> int:
    """The most microbatch-stages a rank holds at once: from each F to its W or full B."""
    held, best = [0] * v, 0
    for kind, s, _ in order:
        if kind == "F":
            held[s // p] += 1
            best = max(best, sum(held))
        elif kind in "BW":
            held[s // p] -= 1
    return best


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_peak_activations_are_deepseek_v3_table_2(p: int, m: int) -> None:
    # In microbatches of one stage: 1F1B and ZB1P hold PP on rank 0 (ZB1P on every rank: rank r
    # delays its W by r); DualPipeV holds PP + 1 with PP = 2p stages, on every rank.
    assert _peak(schedule_cost("1f1b", p, 1, m).orders[0], p, 1) == p
    if m % max(1, m // p) == 0:
        zb = schedule_cost("interleaved_zb", p, 1, m)
        assert [_peak(o, p, 1) for o in zb.orders] == [p] * p
    dv = schedule_cost("dualpipev", p, 2, m)
    assert [_peak(o, p, 2) for o in dv.orders] == [2 * p + 1] * p
    assert dv.max_held[0] == (2 * p, 1)  # rank 0: all its first stage's, one of its last
    # The moments memory.py prices (the start of each B or I) see the peak.
    assert max(sum(mo.held) for mo in dv.moments[0]) == 2 * p + 1
    zbv = schedule_cost("zbv", p, 2, m)
    assert [_peak(o, p, 2) for o in zbv.orders] == [2 * p] * p


def test_overlapped_pair_waits_for_both_inputs() -> None:
    p, m = 2, 4
    orders = [[a for a in rank_order("dualpipev", p, 2, m, r) if a is not None] for r in range(p)]
    pairs = [overlapped_pairs("dualpipev", p, m, r) for r in range(p)]
    assert all(orders[r][i][0] == "F" and orders[r][i + 1][0] == "B" for r in range(p) for i in pairs[r])
    together = simulate(orders, 2 * p, pairs)
    apart = simulate(orders, 2 * p)
    end = [max(t + COST[a[0]] for a, t in zip(o, st)) for o, st in ((orders[r], together[r]) for r in range(p))]
    end_apart = [max(t + COST[a[0]] for a, t in zip(o, st)) for o, st in ((orders[r], apart[r]) for r in range(p))]
    assert max(end) - max(end_apart) == p - 1  # split, the pairs would hide half the bubble


@pytest.mark.parametrize(("schedule", "v"), [("looped_bfs", 2), ("interleaved_zb", 1), ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2)])
def test_bubble_fraction_is_the_orders(schedule: str, v: int) -> None:
    from meshllm_dsl.planner.formulas import bubble_fraction

    for p, m in ((2, 4), (4, 8), (4, 16)):
        assert bubble_fraction(schedule, p, m, v) == schedule_cost(schedule, p, v, m).bubble
    assert bubble_fraction(schedule, 1, 8, v) == 0.0


def test_stage_actions_follow_the_v_placement() -> None:
    from meshllm_dsl.planner.formulas import fsdp_unit_collectives, stage_actions

    p, m = 4, 8
    for schedule in ("zbv", "dualpipev"):
        for stage in range(2 * p):
            actions = stage_actions(schedule, 2 * p, stage, m, p)
            assert actions.count("F") == m and actions.count("I") + actions.count("B") == m
            assert actions.count("W") + actions.count("B") == m
            # FSDP2 under a pipeline: one reduce-scatter, after the stage's last weight gradient
            assert fsdp_unit_collectives(3, actions, m)[1] == 1
    assert set(stage_actions("zbv", 2 * p, 0, m, p)) == {"F", "I", "W"}
    # stage 2p - 1 (the loss) runs on rank 0 with stage 0: its first forward follows stage 0's warm-up
    assert stage_actions("zbv", 2 * p, 2 * p - 1, m, p).startswith("FIW")


@pytest.mark.parametrize(("schedule", "in_flight"), [("zbv", 8), ("dualpipev", 9), ("interleaved_zb", 8), ("looped_bfs", 16)])
def test_planner_prices_the_new_schedules(schedule: str, in_flight: int) -> None:
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.planner.analyze import analyze
    from meshllm_dsl.planner.formulas import bubble_formula

    text = """
mesh m { axes pipeline = 4 }
model l = llama { vocab = 256, hidden = 64, layers = 8, heads = 4, ffn = 128 }
plan p on m for l {
    batch = 8
    seq = 16
    microbatches = 8
    stages over pipeline virtual 2 balanced
    schedule SCHEDULE
}
""".replace("SCHEDULE", schedule)
    plan = check_text(text, "t.mesh").plans["p"]
    # The checker places the stages as the schedule's torch class does.
    assert [s.coord for s in plan.stages] == [stage_coord(s.index, 4, placement_of(schedule)) for s in plan.stages]
    rep = analyze(plan)
    cost = schedule_cost(schedule, 4, 2, 8)
    assert rep.bubble == cost.bubble
    assert [rc.in_flight for rc in rep.ranks] == [in_flight] * 4  # microbatch-stages held at the peak
    assert f"in torch's {schedule} order with p = 4, m = 8, v = 2" in bubble_formula(plan, rep.bubble)


def _plan_report(schedule: str, extra: str = "", mesh: str = "pipeline = 2", model: str = "gpt2", layers: int = 8) -> Any:
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.planner.analyze import analyze

    heads = "heads = 4, positions = 64" if model == "gpt2" else "heads = 4, ffn = 128"
    text = f"""
mesh m {{ axes {mesh} }}
model l = {model} {{ vocab = 256, hidden = 64, layers = {layers}, {heads} }}
plan p on m for l {{
    batch = 8
    seq = 16
    microbatches = 4
    stages over pipeline virtual 2 balanced
    schedule {schedule}
    {extra}
}}
"""
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.errors]
    return analyze(result.plans["p"])


def test_a_v_keeps_tied_weights_and_its_turn_on_one_rank() -> None:
    """Under a V rank 0 holds the first stage and the last: GPT-2's tied embedding and head sum their
    gradients in place (no all-reduce over the pipeline), and the V's turn (stage p - 1 to p, both on
    rank p - 1) sends nothing. Under a loop both cross ranks."""
    def traffic(schedule: str) -> dict[tuple[str, str], int]:
        rep = _plan_report(schedule)
        return {(c.kind, c.op): c.calls for rc in rep.ranks for c in rc.comms}

    loop, v = traffic("interleaved_1f1b"), traffic("zbv")
    assert ("tied", "all_reduce") in loop and ("tied", "all_reduce") not in v
    # Busiest rank's sends: a loop of 4 stages on 2 ranks crosses at every boundary (rank 0's stages
    # 0 and 2: 1 + 2 boundaries), the V at all but its turn (rank 1's stages 1 and 2: one each).
    assert loop[("pipeline", "send_recv")] == 3 * 4 and v[("pipeline", "send_recv")] == 2 * 4


def test_zero3_under_a_split_backward_keeps_units_gathered() -> None:
    """The runtime keeps FSDP2 units gathered from forward to weight gradient under the schedules
    that split backward (ZeRO 3 gathers as ZeRO 2): the planner prices the same."""
    from meshllm_dsl.parallel.placements import gather_stage

    extra = "layout { batch -> data }\n    optimizer adamw { zero 3 }"
    zb = _plan_report("zbv", extra, "data = 2, pipeline = 2", "llama", 16)
    zb2 = _plan_report("zbv", extra.replace("zero 3", "zero 2"), "data = 2, pipeline = 2", "llama", 16)
    looped = _plan_report("looped_bfs", extra, "data = 2, pipeline = 2", "llama", 16)
    assert gather_stage(zb.plan) == 2 and gather_stage(looped.plan) == 3

    def gathers(rep: Any) -> list[int]:
        return [c.calls for rc in rep.ranks for c in rc.comms if (c.kind, c.op) == ("data", "all_gather")]

    # Once per unit a step, as ZeRO 2; looped BFS (full backwards) gathers again after each
    # forward's reshard until its backwards begin.
    assert gathers(zb) == gathers(zb2)
    assert all(a < b for a, b in zip(gathers(zb), gathers(looped)))
