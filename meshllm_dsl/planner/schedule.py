"""Pipeline schedules as the order of actions each rank runs, and what that order costs.

The planner needs two things from a schedule: how many microbatches' activations each virtual stage
of a rank holds at once, and how much of the step the ranks sit idle. Closed forms exist for both
((p - 1) / (m + p - 1), "p - r forwards before the first backward"), but torch's interleaved 1F1B
is not the paper's: its warm-up runs whole rounds of one chunk before the next, so the last chunk of
a rank holds far fewer microbatches than the first, and an even spread over chunks is wrong by
gigabytes on a large plan. So this module writes down the order torch 2.13's
``torch.distributed.pipelining`` runs (ScheduleGPipe / Schedule1F1B step logic,
ScheduleInterleaved1F1B's ``_calculate_single_rank_operations``) and simulates it.

torch-free on purpose: the planner runs where torch is not installed. tests/planner/
test_schedule_order.py holds the generated orders equal to torch's own and the held counts equal to
forwards-minus-backwards counted on real gloo ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# An action: ("F" or "B", global stage index, microbatch). Stage s runs on rank s % p.
Action = tuple[str, int, int]

# Unit costs of the simulation: a backward costs twice its forward (two matmuls per forward one:
# input and weight gradients). The closed-form bubble of GPipe and 1F1B is the same for any ratio;
# the interleaved one is not, and 2:1 is what the planner's 6 = 2 + 4 flops per parameter assume.
FORWARD_COST = 1.0
BACKWARD_COST = 2.0


def _interleaved_rank_order(p: int, v: int, m: int, rank: int) -> list[Action | None]:
    """ScheduleInterleaved1F1B._calculate_single_rank_operations with _get_1f1b_rank_ops (torch 2.13),
    None marking the idle slots torch pads with to align the ranks."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    total = m * v
    fwd_bwd = total - warmup
    cooldown = total - fwd_bwd

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    fwd_mb: dict[int, int] = {}
    bwd_mb: dict[int, int] = {}

    def take(counter: dict[int, int], stage: int) -> int:
        counter[stage] = counter.get(stage, 0) + 1
        return counter[stage] - 1

    post_warmup = (v * p + 2 * (p - 1 - rank)) - (warmup + rank)
    ops: list[Action | None] = [None] * rank
    for op in range(warmup + fwd_bwd + cooldown):
        if op < warmup:
            s = fwd_stage(op)
            ops.append(("F", s, take(fwd_mb, s)))
            if op == warmup - 1:
                ops.extend([None] * post_warmup)
        elif op < warmup + fwd_bwd:
            s = fwd_stage(op)
            ops.append(("F", s, take(fwd_mb, s)))
            s = bwd_stage(op)
            ops.append(("B", s, take(bwd_mb, s)))
        else:
            ops.append(None)
            s = bwd_stage(op)
            ops.append(("B", s, take(bwd_mb, s)))
    return ops


def rank_order(schedule: str, pipeline: int, virtual: int, microbatches: int, rank: int) -> list[Action | None]:
    """The actions pipeline rank `rank` runs in one step, in torch's order.

    GPipe: every forward, then every backward. 1F1B (Schedule1F1B._step_microbatches): stage r runs
    min(m, p - r) forwards, then alternates backward and forward, then drains. Interleaved: torch's
    pipeline_order, idle slots included (None); the single-stage schedules have none (they block on
    their receives instead)."""
    p, v, m = pipeline, virtual, microbatches
    if schedule == "interleaved_1f1b":
        return _interleaved_rank_order(p, v, m, rank)
    if schedule == "gpipe":
        return [("F", rank, j) for j in range(m)] + [("B", rank, j) for j in range(m)]
    if schedule == "1f1b":
        warmup = min(m, p - rank)
        ops: list[Action | None] = [("F", rank, j) for j in range(warmup)]
        for j in range(m - warmup):
            ops += [("B", rank, j), ("F", rank, warmup + j)]
        ops += [("B", rank, j) for j in range(m - warmup, m)]
        return ops
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


@dataclass(frozen=True)
class Moment:
    """A backward about to run on a rank: what is held then (the peak of memory is inside a backward)."""

    held: tuple[int, ...]  # per local stage (the rank's chunks in order): microbatches forwarded, not yet backwarded
    backward_before: bool  # some backward of this rank already ran (gradient accumulators exist)
    follows_backward: bool  # the action before it on this rank was a backward (the drain)


@dataclass(frozen=True)
class ScheduleCost:
    """What one schedule costs, from its action order."""

    orders: tuple[tuple[Action, ...], ...]  # per rank, idle slots dropped
    max_held: tuple[tuple[int, ...], ...]  # per rank, per local stage: the most microbatches held at once
    moments: tuple[tuple[Moment, ...], ...]  # per rank: the distinct states at the start of a backward
    makespan: float  # unit-cost step length (F = FORWARD_COST, B = BACKWARD_COST)
    busy: float  # each rank's work in those units (the same on every rank)

    @property
    def bubble(self) -> float:
        """Idle fraction of the step: idle / makespan, (p - 1) / (m + p - 1) for GPipe and 1F1B."""
        return (self.makespan - self.busy) / self.makespan if self.makespan else 0.0

    @property
    def bubble_over_busy(self) -> float:
        """Idle time over work time: (p - 1) / m for GPipe and 1F1B, what stretches the busy time."""
        return (self.makespan - self.busy) / self.busy if self.busy else 0.0


def _simulate(orders: list[list[Action]], stages: int) -> float:
    """Finish time of the step: each rank runs its actions in order, each as soon as its input is
    there (a forward after the previous stage's forward of that microbatch, a backward after the next
    stage's backward, or the stage's own forward on the last stage); communication is free."""
    done: dict[Action, float] = {}
    pos = [0] * len(orders)
    clock = [0.0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, s, j = order[pos[r]]
                dep = (("F", s - 1, j) if s > 0 else None) if kind == "F" else (
                    ("B", s + 1, j) if s < stages - 1 else ("F", s, j))
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = start + (FORWARD_COST if kind == "F" else BACKWARD_COST)
                done[(kind, s, j)] = clock[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the pipeline order deadlocks")  # no schedule torch ships does
    return max(clock)


@lru_cache(maxsize=256)
def schedule_cost(schedule: str, pipeline: int, virtual: int, microbatches: int) -> ScheduleCost:
    """Held microbatches per (rank, virtual stage) and the bubble of one step of `schedule`."""
    p, v, m = pipeline, virtual, microbatches
    v = v if schedule == "interleaved_1f1b" else 1
    orders = [[a for a in rank_order(schedule, p, v, m, r) if a is not None] for r in range(p)]
    max_held = []
    moments = []
    for order in orders:
        held = [0] * v
        peak = [0] * v
        seen: dict[Moment, None] = {}
        backward_before = follows_backward = False
        for kind, s, _ in order:
            chunk = s // p
            if kind == "F":
                held[chunk] += 1
                peak[chunk] = max(peak[chunk], held[chunk])
                follows_backward = False
            else:
                seen.setdefault(Moment(tuple(held), backward_before, follows_backward))
                held[chunk] -= 1
                backward_before = follows_backward = True
        max_held.append(tuple(peak))
        moments.append(tuple(seen))
    busy = m * v * (FORWARD_COST + BACKWARD_COST)
    return ScheduleCost(tuple(tuple(o) for o in orders), tuple(max_held), tuple(moments),
                        _simulate(orders, p * v) if p > 1 else busy, busy)


def rank_moments(schedule: str, pipeline: int, virtual: int, microbatches: int, rank: int) -> tuple[Moment, ...]:
    """The states of pipeline rank `rank` at the start of each of its backwards (deduplicated).
    Without a pipeline the microbatches are gradient accumulation: one held at a time."""
    if pipeline <= 1:
        return (Moment((1,), microbatches > 1, False),)
    return schedule_cost(schedule, pipeline, virtual, microbatches).moments[rank]
