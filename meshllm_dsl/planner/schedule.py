"""Pipeline schedules as the order of actions each rank runs, and what that order costs.

The planner needs two things from a schedule: how many microbatches' activations each virtual stage
of a rank holds at once, and how much of the step the ranks sit idle. Closed forms exist for both
((p - 1) / (m + p - 1), "p - r forwards before the first backward"), but torch's interleaved 1F1B
is not the paper's: its warm-up runs whole rounds of one chunk before the next, so the last chunk of
a rank holds far fewer microbatches than the first, and an even spread over chunks is wrong by
gigabytes on a large plan. So this module writes down the order torch 2.13's
``torch.distributed.pipelining`` runs (ScheduleGPipe / Schedule1F1B step logic, and the
``_calculate_single_rank_operations`` of ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV) and simulates it.

The zero-bubble schedules split a backward into I (input gradient: what the previous stage waits
for) and W (weight gradient: nobody waits for it, so it fills idle slots); DualPipeV also runs
overlapped forward+backward pairs, written here as their two actions. A microbatch's activations
on a stage are held from its F until its W (or its full B): W needs the layers' inputs.

With these unit costs (F = I = W = 1, B = 2) the simulated idle time per rank is the DeepSeek-V3
report's Table 2 (1F1B (p - 1)(F + B), ZB1P (p - 1)(F + B - 2W), DualPipeV on p ranks
(p - 1)(F&B + B - 3W)): IDLE_NOTES below, and tests/planner/test_schedule_zero_bubble.py.

torch-free on purpose: the planner runs where torch is not installed. tests/planner/
test_schedule_order.py holds the generated orders equal to torch's own and the held counts equal to
forwards-minus-backwards counted on real gloo ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from meshllm_dsl.ir import placement_of, stage_coord

# An action: (kind, global stage index, microbatch), kind "F" (forward), "B" (full backward), "I"
# (input-gradient backward) or "W" (weight-gradient backward). Stage s runs on rank
# stage_coord(s, p, placement_of(schedule)); it is local stage ("chunk") s // p of that rank in
# either placement (V: chunk 0 = stage r, chunk 1 = stage 2p - 1 - r).
Action = tuple[str, int, int]

# Unit costs of the simulation: a backward costs twice its forward (two matmuls per forward one:
# input and weight gradients). The closed-form bubble of GPipe and 1F1B is the same for any ratio;
# the interleaved one is not, and 2:1 is what the planner's 6 = 2 + 4 flops per parameter assume.
# Split, the backward is its two halves: I and W one forward each.
FORWARD_COST = 1.0
BACKWARD_COST = 2.0
INPUT_COST = 1.0
WEIGHT_COST = 1.0
COST = {"F": FORWARD_COST, "B": BACKWARD_COST, "I": INPUT_COST, "W": WEIGHT_COST}

# IDLE_NOTES: the idle time per rank (makespan - busy) these costs give torch's orders, measured
# (tests/planner/test_schedule_zero_bubble.py), and the held microbatch-stages per rank at the peak:
#   1f1b                   3(p - 1) = (p - 1)(F + B), Table 2's        holds p on rank 0 (p - r on rank r)
#   interleaved_zb v = 1   p - 1 = (p - 1)(F + B - 2W), Table 2's ZB1P holds p on every rank (rank r delays its W by r)
#   dualpipev (2p stages)  2(p - 1) = (p - 1)(F&B + B - 3W), Table 2's with F&B = F + B, m >= 2p;
#                          holds 2p + 1 (PP + 1, PP = 2p stages) on every rank: (2p, 1) on rank 0.
#                          That needs the overlapped pair to start once both its inputs are there
#                          (torch receives both before it runs the pair); run as two free actions
#                          the pair would hide half the bubble: p - 1.
#   zbv                    max(p - 1, 2(2p - 1 - m)): p - 1 once m >= 2p - 1 (the floor: the last rank's
#                          first input is p - 1 forwards away); holds 2p on every rank.
#   interleaved_zb v >= 2  p - 1 for m >= p
#   looped_bfs             3(p - 1) + 3(v - 1) max(0, p - m): GPipe's; holds every microbatch of every stage


def _round_stages(p: int, v: int, per_round: int, warmup: int, rank: int) -> tuple[Callable[[int], int], Callable[[int], int]]:
    """The global stage of a rank's step-th forward and backward in torch's interleaved classes
    (ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble share it): whole rounds of
    `per_round` microbatches on one chunk before the next, the backwards from the last chunk down."""

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    return fwd_stage, bwd_stage


def _interleaved_rank_order(p: int, v: int, m: int, rank: int) -> list[Action | None]:
    """ScheduleInterleaved1F1B._calculate_single_rank_operations with _get_1f1b_rank_ops (torch 2.13),
    None marking the idle slots torch pads with to align the ranks."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    total = m * v
    fwd_bwd = total - warmup
    cooldown = total - fwd_bwd

    fwd_stage, bwd_stage = _round_stages(p, v, per_round, warmup, rank)

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


def _looped_bfs_rank_order(p: int, v: int, m: int, rank: int) -> list[Action | None]:
    """ScheduleLoopedBFS._calculate_single_rank_operations (torch 2.13): every microbatch's forward
    of the rank's first chunk, then of the next, then the backwards in reverse (last chunk first,
    last microbatch first), with torch's idle padding."""
    chunks = range(rank, p * v, p)
    ops: list[Action | None] = [None] * rank
    for s in chunks:
        ops += [("F", s, j) for j in range(m)]
    ops += [None] * (2 * (p - 1 - rank))  # torch: the first backward trickles up, 2 a hop
    for s in reversed(chunks):
        ops += [("B", s, j) for j in reversed(range(m))]
    return ops


def _zb1p_rank_order(p: int, v: int, m: int, rank: int) -> list[Action | None]:
    """ScheduleInterleavedZeroBubble._calculate_single_rank_operations: _get_warmup_ops with
    multiply_factor 1 and _get_1f1b_rank_ops(enable_zero_bubble=True), before the bubbles torch adds
    across ranks (_zb1p_orders). The backward is split: each I of the steady state is followed by
    the W of the oldest I not yet weighted, once rank r has run r of them (ZB1P's W delay)."""
    rounds = max(1, m // p)
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + (p - 1 - rank), total)
    fwd_bwd = total - warmup
    cooldown = total - fwd_bwd

    fwd_stage, bwd_stage = _round_stages(p, v, per_round, warmup, rank)

    counters: dict[tuple[str, int], int] = {}

    def act(kind: str, stage: int) -> Action:
        j = counters.get((kind, stage), 0)
        counters[(kind, stage)] = j + 1
        return (kind, stage, j)

    ops: list[Action | None] = [None] * rank
    backward_steps: list[int] = []
    weighted = 0
    for op in range(warmup + fwd_bwd + cooldown):
        if op < warmup:
            ops.append(act("F", fwd_stage(op)))
            if op == warmup - 1:
                ops.extend([None] * (p - rank - 1))
            continue
        if op < warmup + fwd_bwd:
            ops.append(act("F", fwd_stage(op)))
        ops.append(act("I", bwd_stage(op)))
        backward_steps.append(op)
        if op - warmup >= rank:
            ops.append(act("W", bwd_stage(backward_steps[weighted])))
            weighted += 1
    while weighted < len(backward_steps):
        ops.append(act("W", bwd_stage(backward_steps[weighted])))
        weighted += 1
    return ops


@lru_cache(maxsize=64)
def _zb1p_orders(p: int, v: int, m: int) -> tuple[tuple[Action | None, ...], ...]:
    """Every rank's ZB1P order after ScheduleInterleavedZeroBubble._add_bubbles_to_actions: the
    ranks advance one slot at a time together, and a forward whose previous stage's forward has not
    run in an earlier slot waits (an idle slot, None). torch checks only forwards and full backwards
    there, and ZB1P has no full backward."""
    raw = [_zb1p_rank_order(p, v, m, r) for r in range(p)]
    seen: set[Action] = set()
    result: list[list[Action | None]] = [[] for _ in range(p)]
    pos = [0] * p
    while any(pos[r] < len(raw[r]) for r in range(p)):
        ran: set[Action] = set()
        for r in range(p):
            if pos[r] >= len(raw[r]):
                continue
            a = raw[r][pos[r]]
            if a is not None and a[0] == "F" and a[1] != 0 and ("F", a[1] - 1, a[2]) not in seen:
                result[r].append(None)
                continue
            result[r].append(a)
            if a is not None:
                ran.add(a)
            pos[r] += 1
        seen |= ran
    return tuple(tuple(o) for o in result)


def _zbv_rank_order(p: int, m: int, rank: int) -> list[Action | None]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations (torch 2.13): the V placement (rank r
    holds stage r as chunk 0 and stage 2p - 1 - r as chunk 1), a warm-up of chunk-0 forwards, then
    F/I/W of one chunk after the other. torch builds it for max(2p - 1, m) microbatches and turns
    every action of a microbatch >= m into an idle slot (None): with fewer microbatches the order
    names no microbatch beyond m - 1, it just leaves those slots empty."""
    n = max(2 * p - 1, m)
    s0, s1 = rank, 2 * p - 1 - rank
    ops: list[Action | None] = [None] * rank
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        ops.append(("F", s0, f0))
        f0 += 1
    for _ in range(rank):
        ops += [("F", s1, f1), ("F", s0, f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):
        ops += [("F", s1, f1), ("I", s1, b1), ("W", s1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(("F", s0, f0))
            f0 += 1
        ops += [("I", s0, b0), ("W", s0, b0), ("F", s1, f1), ("I", s1, b1), ("W", s1, b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [("I", s0, b0), ("I", s1, b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):
        ops += [("I", s0, b0), ("W", s0, w0)]
        b0 += 1
        w0 += 1
    ops += [("W", s1, j) for j in range(w1, b1)]
    ops += [("W", s0, j) for j in range(w0, b0)]
    return [a if a is not None and a[2] < m else None for a in ops]


def _dualpipev_rank_order(p: int, m: int, rank: int, pairs: list[int] | None = None) -> list[Action | None]:
    """ScheduleDualPipeV._calculate_single_rank_operations (torch 2.13, after DeepSeek's DualPipe
    code): the V placement, eight steps of forwards, zero-bubble I/W pairs, overlapped
    forward+backward pairs (OVERLAP_F_B, written here as its two sub-actions, the forward then the
    full backward, which is how the pair costs: their sum) and a drain. A full backward takes the
    microbatch of the stage's I counter and advances the W one with it; each I queues its W, and
    the W slots pop that queue oldest first. `pairs` collects the index of each pair's forward
    (DualPipeV has no idle slots, so it is the index in the order without them too)."""
    s0, s1 = rank, 2 * p - 1 - rank
    counters: dict[tuple[int, str], int] = {}
    queue: list[tuple[int, int]] = []
    ops: list[Action | None] = []

    def add(stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        j = counters.get(key, 0)
        ops.append((kind, stage, j))
        if kind == "B":
            counters[(stage, "I")] = counters.get((stage, "I"), 0) + 1
            counters[(stage, "W")] = counters.get((stage, "W"), 0) + 1
            return
        if kind == "I":
            queue.append((stage, j))
        counters[key] = j + 1

    def weight() -> None:
        if queue:
            stage, j = queue.pop(0)
            ops.append(("W", stage, j))
            counters[(stage, "W")] = counters.get((stage, "W"), 0) + 1

    def overlap(forward: int, backward: int) -> None:  # OVERLAP_F_B: its F, then its full B
        if pairs is not None:
            pairs.append(len(ops))
        add(forward, "F")
        add(backward, "B")

    for _ in range((p - rank - 1) * 2):  # step 1: F0
        add(s0, "F")
    for _ in range(rank + 1):  # step 2: F0 F1
        add(s0, "F")
        add(s1, "F")
    for _ in range(p - rank - 1):  # step 3: I1 W1 F1
        add(s1, "I")
        weight()
        add(s1, "F")
    for i in range(m - 2 * p + rank + 1):  # step 4: F0B1 - F1B0, overlapped
        if i == 0 and rank == p - 1:  # torch: not overlapped, to shorten the bubble
            add(s0, "F")
            add(s1, "B")
        else:
            overlap(s0, s1)
        overlap(s1, s0)
    for _ in range(p - rank - 1):  # step 5: B1 - F1B0
        add(s1, "B")
        overlap(s1, s0)
    zero_bubble = False
    half = (rank + 1) // 2
    for i in range(rank + 1):  # step 6: B1 B0, the second half split (I now, W later)
        if i == half and rank % 2 == 1:
            zero_bubble = True
        add(s1, "I" if zero_bubble else "B")
        if i == half and rank % 2 == 0:
            zero_bubble = True
        add(s0, "I" if zero_bubble else "B")
    for _ in range(p - rank - 1):  # step 7: W0 B0
        weight()
        add(s0, "I" if zero_bubble else "B")
    for _ in range(rank + 1):  # step 8: W0
        weight()
    return ops


def stages_per_rank(schedule: str, virtual: int) -> int:
    """The local stages each rank runs under `schedule`: 1 for the single-stage schedules, 2 for the V
    ones (torch refuses any other count), `virtual` for the looped ones."""
    if schedule in ("gpipe", "1f1b"):
        return 1
    if schedule in ("zbv", "dualpipev"):
        return 2
    return virtual


def rank_order(schedule: str, pipeline: int, virtual: int, microbatches: int, rank: int) -> list[Action | None]:
    """The actions pipeline rank `rank` runs in one step, in torch's order.

    GPipe: every forward, then every backward. 1F1B (Schedule1F1B._step_microbatches): stage r runs
    min(m, p - r) forwards, then alternates backward and forward, then drains. The multi-stage
    schedules: torch's pipeline_order, idle slots included (None); the single-stage schedules have
    none (they block on their receives instead). `virtual` is ignored where torch fixes it."""
    p, v, m = pipeline, virtual, microbatches
    if schedule == "interleaved_1f1b":
        return _interleaved_rank_order(p, v, m, rank)
    if schedule == "looped_bfs":
        return _looped_bfs_rank_order(p, v, m, rank)
    if schedule == "interleaved_zb":
        return list(_zb1p_orders(p, v, m)[rank])
    if schedule == "zbv":
        return _zbv_rank_order(p, m, rank)
    if schedule == "dualpipev":
        return _dualpipev_rank_order(p, m, rank)
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
    """A backward (B or I) about to run on a rank: what is held then (the peak of memory is inside a backward)."""

    held: tuple[int, ...]  # per local stage (the rank's chunks in order): microbatches forwarded, not yet through W or B
    backward_before: bool  # some B or W of this rank already ran (gradient accumulators exist; an I makes none)
    follows_backward: bool  # the action before it on this rank was a backward, B, I or W (the drain)


@dataclass(frozen=True)
class ScheduleCost:
    """What one schedule costs, from its action order."""

    orders: tuple[tuple[Action, ...], ...]  # per rank, idle slots dropped
    max_held: tuple[tuple[int, ...], ...]  # per rank, per local stage: the most microbatches held at once
    moments: tuple[tuple[Moment, ...], ...]  # per rank: the distinct states at the start of a backward
    makespan: float  # unit-cost step length (COST: F = FORWARD_COST, B = BACKWARD_COST, I, W)
    busy: float  # each rank's work in those units (the same on every rank)
    starts: tuple[tuple[float, ...], ...] = ()  # per rank, each action of `orders`' simulated start

    @property
    def bubble(self) -> float:
        """Idle fraction of the step: idle / makespan, (p - 1) / (m + p - 1) for GPipe and 1F1B."""
        return (self.makespan - self.busy) / self.makespan if self.makespan else 0.0

    @property
    def bubble_over_busy(self) -> float:
        """Idle time over work time: (p - 1) / m for GPipe and 1F1B, what stretches the busy time."""
        return (self.makespan - self.busy) / self.busy if self.busy else 0.0

    @property
    def idle(self) -> float:
        """Idle time per rank in the unit costs: makespan - busy (3(p - 1) for 1F1B)."""
        return self.makespan - self.busy


def dependency(action: Action, stages: int) -> tuple[str, int, int] | None:
    """What `action` waits for: a forward for the previous stage's forward of that microbatch; an I
    or B for the next stage's I or B ("G"), or the stage's own forward on the last stage; a W for its
    own I."""
    kind, s, j = action
    if kind == "F":
        return ("F", s - 1, j) if s > 0 else None
    if kind == "W":
        return ("G", s, j)
    return ("G", s + 1, j) if s < stages - 1 else ("F", s, j)


def simulate(orders: list[list[Action]], stages: int,
             pairs: list[frozenset[int]] | None = None) -> list[list[float]]:
    """Start time of each action: each rank runs its actions in order, each as soon as its input is
    there (dependency), an overlapped pair (`pairs`: the index of its forward, per rank) once both
    its inputs are; communication is free. The result does not depend on the order the ranks are
    visited in."""
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G" (the I or B) | "W", stage, microbatch) -> end
    starts: list[list[float]] = [[] for _ in orders]
    pos = [0] * len(orders)
    clock = [0.0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, s, j = order[pos[r]]
                deps = [dependency(order[pos[r]], stages)]
                if pairs is not None and pos[r] in pairs[r]:
                    deps.append(dependency(order[pos[r] + 1], stages))
                if any(d is not None and d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps if d is not None])
                starts[r].append(start)
                clock[r] = start + COST[kind]
                done[("G" if kind in "IB" else kind, s, j)] = clock[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the pipeline order deadlocks")  # no schedule torch ships does
    return starts


def _held(order: tuple[Action, ...], p: int, v: int) -> tuple[tuple[int, ...], tuple[Moment, ...]]:
    """The most microbatches each local stage of a rank holds, and the distinct states at the start of
    its backwards (B or I). Held from a microbatch's F to its W or full B."""
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
            continue
        if kind in "BI":
            seen.setdefault(Moment(tuple(held), backward_before, follows_backward))
        if kind in "BW":
            held[chunk] -= 1
            backward_before = True
        follows_backward = True
    return tuple(peak), tuple(seen)


@lru_cache(maxsize=256)
def schedule_cost(schedule: str, pipeline: int, virtual: int, microbatches: int) -> ScheduleCost:
    """Held microbatches per (rank, virtual stage) and the bubble of one step of `schedule`."""
    p, m = pipeline, microbatches
    v = stages_per_rank(schedule, virtual)
    orders = tuple(tuple(a for a in rank_order(schedule, p, v, m, r) if a is not None) for r in range(p))
    placement = placement_of(schedule)
    assert all(stage_coord(s, p, placement) == r for r, o in enumerate(orders) for _, s, _ in o)
    held = [_held(o, p, v) for o in orders]
    busy = m * v * (FORWARD_COST + INPUT_COST + WEIGHT_COST)
    starts = simulate([list(o) for o in orders], p * v, [overlapped_pairs(schedule, p, m, r) for r in range(p)])
    makespan = max(t + COST[a[0]] for o, st in zip(orders, starts) for a, t in zip(o, st)) if p > 1 else busy
    return ScheduleCost(orders, tuple(h[0] for h in held), tuple(h[1] for h in held), makespan, busy,
                        tuple(tuple(s) for s in starts))


def rank_moments(schedule: str, pipeline: int, virtual: int, microbatches: int, rank: int) -> tuple[Moment, ...]:
    """The states of pipeline rank `rank` at the start of each of its backwards (deduplicated).
    Without a pipeline the microbatches are gradient accumulation: one held at a time."""
    if pipeline <= 1:
        return (Moment((1,), microbatches > 1, False),)
    return schedule_cost(schedule, pipeline, virtual, microbatches).moments[rank]


@lru_cache(maxsize=64)
def overlapped_pairs(schedule: str, pipeline: int, microbatches: int, rank: int) -> frozenset[int]:
    """Where `rank`'s order (idle slots dropped) runs an overlapped forward+backward pair
    (DualPipeV's OVERLAP_F_B): the index of the pair's forward; its backward follows it. torch
    receives both inputs before it runs the pair (_add_send_recv schedules the pair's receives
    together), so the pair starts when both are there."""
    if schedule != "dualpipev":
        return frozenset()
    pairs: list[int] = []
    _dualpipev_rank_order(pipeline, microbatches, rank, pairs)
    return frozenset(pairs)
