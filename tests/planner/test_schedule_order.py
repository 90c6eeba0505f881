"""meshllm_dsl.planner.schedule against torch's own pipeline schedules: the same action order (torch's
schedule code run without a process group) and the same microbatches held per virtual stage
(forwards minus backwards counted on real gloo ranks running the real schedule)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from meshllm_dsl.planner.formulas import bubble_fraction
from meshllm_dsl.planner.schedule import rank_order, schedule_cost

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def _plain(action: Any) -> tuple[str, int, int] | None:
    if action is None:
        return None
    kind = {schedules.FORWARD: "F", schedules.FULL_BACKWARD: "B"}[action.computation_type]
    return (kind, action.stage_index, action.microbatch_index)


INTERLEAVED_GRID = [(p, v, m) for p, v, m in itertools.product((2, 3, 4, 8), (2, 3, 4), (1, 2, 3, 4, 6, 8, 12, 16))
                    if m % max(1, m // p) == 0]


@pytest.mark.parametrize(("p", "v", "m"), INTERLEAVED_GRID)
def test_interleaved_order_is_torchs_pipeline_order(p: int, v: int, m: int) -> None:
    # ScheduleInterleaved1F1B's constructor wants real stages and a process group; the order comes
    # from _calculate_single_rank_operations, which reads only these four attributes.
    sched = schedules.ScheduleInterleaved1F1B.__new__(schedules.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.microbatches_per_round = m // max(1, m // p)
    for rank in range(p):
        theirs = [_plain(a) for a in sched._calculate_single_rank_operations(rank)]
        assert rank_order("interleaved_1f1b", p, v, m, rank) == theirs


class _RecordingStage:
    """What PipelineScheduleSingle._step_microbatches touches on its stage, recording the compute."""

    def __init__(self, index: int, stages: int, log: list[tuple[str, int, int]]) -> None:
        self.stage_index, self.num_stages, self.log = index, stages, log
        self.is_first, self.is_last = index == 0, index == stages - 1

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.log.append(("F", self.stage_index, mb))

    def backward_one_chunk(self, mb: int, **kwargs: Any) -> None:
        self.log.append(("B", self.stage_index, mb))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("get_") and name.endswith("_ops"):
            return lambda *a, **k: []  # no communication: _batch_p2p of [] does nothing
        if name == "perform_reduce_grad":
            return lambda *a, **k: None
        raise AttributeError(name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (2, 3, 4, 8) for m in (p, p + 1, 2 * p, 3 * p + 1)])
def test_single_stage_order_is_torchs_step(schedule: str, p: int, m: int) -> None:
    cls = schedules.ScheduleGPipe if schedule == "gpipe" else schedules.Schedule1F1B
    for rank in range(p):
        log: list[tuple[str, int, int]] = []
        sched = cls.__new__(cls)
        sched._stage, sched._n_microbatches, sched._num_stages = _RecordingStage(rank, p, log), m, p
        sched._loss_fn, sched._has_backward, sched._internal_losses, sched.scale_grads = None, True, [], True
        sched._check_inputs = lambda a, k, t, losses: ([()] * m, [{}] * m)
        sched._initialize_stage = lambda *a, **k: None
        sched._step_microbatches()  # torch's own step logic, on the recording stage
        assert rank_order(schedule, p, 1, m, rank) == log


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (8, 9), (16, 32)])
def test_1f1b_holds_min_m_p_minus_rank_and_the_closed_form_bubble(p: int, m: int) -> None:
    for schedule in ("1f1b", "gpipe"):
        cost = schedule_cost(schedule, p, 1, m)
        expect = [(min(m, p - r),) if schedule == "1f1b" else (m,) for r in range(p)]
        assert list(cost.max_held) == expect
        assert cost.bubble == pytest.approx(bubble_fraction(schedule, p, m))
        assert cost.bubble_over_busy == pytest.approx((p - 1) / m)


def test_interleaved_holds_fewer_on_the_later_chunks() -> None:
    # torch warms up a whole round of chunk 0 before chunk 1, so chunk 0 of rank 0 holds every
    # microbatch and the head's chunk (stage 15 on rank 7) one: not an even spread over chunks.
    cost = schedule_cost("interleaved_1f1b", 8, 2, 16)
    assert cost.max_held[0] == (16, 8)
    assert cost.max_held[7] == (9, 1)
    # With m a multiple of p the order reaches Megatron's (p - 1) / (v m) idle over busy exactly.
    assert cost.bubble_over_busy == pytest.approx(7 / 32)


# --- the real schedule on gloo ranks ---------------------------------------------------------------

def _held_on_gloo(ctx: Any, schedule: str, p: int, v: int, m: int) -> dict[int, int]:
    """Run one training step of torch's schedule over tiny Linear stages; per stage on this rank,
    the most microbatches forwarded but not yet backwarded at any moment."""
    from torch import nn
    from torch.distributed import pipelining as pl

    torch.manual_seed(0)
    mesh = ctx.mesh((("pipeline", p),))
    group = mesh.group("pipeline")
    n = p * v
    ids = [ctx.rank + k * p for k in range(v)]
    stages = [pl.PipelineStage(nn.Linear(4, 4), stage_index=i, num_stages=n, device=torch.device("cpu"),
                               input_args=torch.zeros(2, 4, requires_grad=i > 0),
                               output_args=torch.zeros(2, 4, requires_grad=True), group=group)
              for i in ids]
    held = dict.fromkeys(ids, 0)
    peak = dict.fromkeys(ids, 0)
    for st in stages:
        fwd, bwd = st.forward_one_chunk, st.backward_one_chunk

        def forward(*a: Any, _i: int = st.stage_index, _f: Any = fwd, **k: Any) -> Any:
            held[_i] += 1
            peak[_i] = max(peak[_i], held[_i])
            return _f(*a, **k)

        def backward(*a: Any, _i: int = st.stage_index, _b: Any = bwd, **k: Any) -> Any:
            out = _b(*a, **k)
            held[_i] -= 1
            return out

        st.forward_one_chunk, st.backward_one_chunk = forward, backward
    cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved_1f1b": pl.ScheduleInterleaved1F1B}[schedule]
    sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=lambda y, t: (y - t).pow(2).mean())
    x = torch.randn(2 * m, 4)
    if ctx.rank == 0:
        sched.step(x, target=x) if ctx.rank == (n - 1) % p else sched.step(x)
    else:
        sched.step(target=x) if ctx.rank == (n - 1) % p else sched.step()
    assert all(h == 0 for h in held.values())
    return peak


@pytest.mark.parametrize(("schedule", "p", "v", "m"), [
    ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 2, 2, 8), ("1f1b", 4, 1, 4), ("1f1b", 4, 1, 8),
    ("gpipe", 4, 1, 4), ("interleaved_1f1b", 4, 2, 8),
])
def test_held_per_virtual_stage_matches_gloo_ranks(pool: Any, schedule: str, p: int, v: int, m: int) -> None:
    measured = pool.run(_held_on_gloo, p, schedule, p, v, m)
    cost = schedule_cost(schedule, p, v, m)
    for rank, peak in enumerate(measured):
        assert tuple(peak[rank + k * p] for k in range(v)) == cost.max_held[rank]


# --- the planner reads the order ------------------------------------------------------------------

def test_planner_activations_are_held_counts_times_each_chunks_bytes() -> None:
    from pathlib import Path

    from meshllm_dsl.checker import check_file
    from meshllm_dsl.planner.analyze import analyze

    result = check_file(Path(__file__).parents[2] / "examples" / "llama2_70b_train.mesh")
    rep = analyze(result.plans["train_64"])  # pipeline 2 x virtual 2, 32 microbatches, ZeRO-3
    head_rank = rep.ranks[1]  # stages 1 and 3 (blocks 20-39; blocks 60-79, norm, lm_head)
    # Its heaviest moment is the drain, holding two microbatches of stage 1 and none of the head's
    # stage 3; the even spread charged one of each (the whole per-microbatch sum).
    assert schedule_cost("interleaved_1f1b", 2, 2, 32).moments[1][3].held == (2, 0)
    assert head_rank.in_flight == 2
    assert head_rank.activation_bytes < head_rank.activation_bytes_per_microbatch
    # torch's order idles (p - 1) slots of v m: 1 / 65, not the closed form's 1 / 66.
    assert rep.bubble == pytest.approx(1 / 65)


def test_interleaved_plan_prints_the_orders_bubble_and_the_closed_form() -> None:
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.planner.analyze import analyze
    from meshllm_dsl.planner.report import report_text

    result = check_text("""
mesh m {
    axes pipeline = 4
    device = h100
}
model l = llama { vocab = 256, hidden = 64, layers = 8, heads = 4, kv_heads = 2, ffn = 128 }
plan p on m for l {
    batch = 4
    seq = 16
    microbatches = 4
    stages over pipeline virtual 2 balanced
    schedule interleaved_1f1b
}
""")
    assert result.ok, result.diagnostics
    rep = analyze(result.plans["p"])
    # p = 4, v = 2, m = 4: torch's order idles 3 of 11 slots' worth, the closed form says 3 / 14.
    assert rep.bubble == pytest.approx(3 / 11)
    assert "27.3% in torch's interleaved_1f1b order (the closed form (p - 1) / (m + p - 1) / v" in report_text(rep)
    last = rep.ranks[3]  # stages 3 and 7 (the head): 4 microbatches of stage 3, 1 of stage 7 at once
    assert last.in_flight == 5 and schedule_cost("interleaved_1f1b", 4, 2, 4).max_held[3] == (4, 1)
    assert last.activation_bytes < last.activation_bytes_per_microbatch * 5 // 2  # less than the even spread


def test_fsdp_stage_actions_are_torchs_interleaved_rounds() -> None:
    from meshllm_dsl.planner.formulas import stage_actions

    # What FSDP2's gathers are counted over. Pipeline 2 x virtual 2, 4 microbatches: stage 2 (rank
    # 0's second chunk) runs a round of two forwards, then their backwards; 1F1B over the 4 virtual
    # stages, the old approximation, said FFBFBFBB.
    assert [stage_actions("interleaved_1f1b", 4, i, 4, 2) for i in range(4)] == [
        "FFFFBBBB", "FFFBFBBB", "FFBBFFBB", "FBFBFBFB"]
    assert stage_actions("1f1b", 4, 1, 6) == "FFFBFBFBFBBB"  # single-stage schedules unchanged


LLAMA_405B_LIKE = """
mesh m {{
    axes pipeline = 8, data = 8, tensor = 8
    hosts = 64
    device = h100
}}
model l = llama {{ vocab = 128256, hidden = 16384, layers = 128, heads = 128, kv_heads = 8, ffn = 53248 }}
plan p on m for l {{
    batch = 256
    seq = 8192
    microbatches = 8
    recompute = blocks
    layout {{ batch -> data, heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor, seq -> tensor }}
    stages over pipeline {stages}
    schedule {schedule}
    precision {{ params = bf16, master = fp32, reduce = fp32 }}
    optimizer adamw {{ zero 3 over data }}
}}
"""


def test_405b_like_plan_holds_torchs_counts_and_as_many_blocks_either_schedule() -> None:
    # torchtitan's Table 5 (Llama 3.1 405B on PP 8 x TP 8 x FSDP 8, 8 microbatches: its default
    # pipeline_parallel_microbatches is the pipeline degree) logs 82.5 GiB under 1F1B and 72.7 GiB
    # interleaved. Here with 128 blocks (16 stages of 8). In torch's own interleaved order (its
    # warm-up, (v - 1) p + 2 (p - 1 - r) = 22 on rank 0, exceeds the 16 forwards) rank 0 runs
    # every forward before its first backward: 8 microbatches of each chunk, 16 x 8 blocks, as many
    # as 1F1B's 8 x 16. So the activations in flight do not make interleaving lighter at m = p.
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.planner.analyze import analyze

    p, v, m = 8, 2, 8
    sched = schedules.ScheduleInterleaved1F1B.__new__(schedules.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.microbatches_per_round = m // max(1, m // p)
    cost = schedule_cost("interleaved_1f1b", p, v, m)
    for rank in range(p):
        held, peak = [0] * v, [0] * v
        for action in map(_plain, sched._calculate_single_rank_operations(rank)):
            if action is not None:
                chunk = action[1] // p
                held[chunk] += 1 if action[0] == "F" else -1
                peak[chunk] = max(peak[chunk], held[chunk])
        assert tuple(peak) == cost.max_held[rank]
    assert cost.max_held[0] == (8, 8) and cost.max_held[7] == (8, 1)
    assert schedule_cost("1f1b", p, 1, m).max_held[0] == (8,)

    reps = {}
    for schedule, stages in (("1f1b", "balanced"), ("interleaved_1f1b", "virtual 2 balanced")):
        result = check_text(LLAMA_405B_LIKE.format(schedule=schedule, stages=stages), f"{schedule}.mesh")
        assert result.ok, [d.message for d in result.errors]
        reps[schedule] = analyze(next(iter(result.plans.values())))
    # At rank 0's peak (a backward starting) the planner holds, besides the microbatch whose
    # backward runs (a stage of 16 blocks, or a chunk of 8), 7 x 16 and 15 x 8 blocks: 128 either way.
    one, inter = reps["1f1b"].ranks[0], reps["interleaved_1f1b"].ranks[0]
    assert (one.in_flight + 1) * 16 == (inter.in_flight + 1) * 8 == 128
    assert one.activation_bytes_per_microbatch == inter.activation_bytes_per_microbatch  # both chunks of it
