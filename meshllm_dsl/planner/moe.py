"""The planner's mixture-of-experts model: routed pairs at capacity, active parameters, and what a
routing skew does to each expert-parallel rank.

`skew = F` in a plan: in every moe layer the busiest expert receives a share F of the layer's routed
(token, choice) pairs and the other experts share the rest evenly. Experts split over an expert-
parallel group of degree d (E / d experts per rank; tokens travel to their experts' ranks), the rank
holding the busiest expert gets F + (E / d - 1) (1 - F) / (E - 1) of the group's d x T x k pairs and
every other rank E / d x (1 - F) / (E - 1), against 1 / d each when balanced; a capacity factor caps
each expert at d x ceil(capacity x T x k / E) (runtime/moe/routing.py counts it per source rank).
The experts' saved activations and matmuls scale with a rank's pairs; the other ranks wait for the
busiest at each layer's combine. The all-to-alls are uneven too: every source rank routes alike, so
a rank receives (d - 1) / d of the pairs it computes from the other ranks in the dispatch (and sends
them back in the combine); each call lasts as long as the busiest rank's share, pairs_busiest /
pairs_balanced times the balanced call, and that stretches every rank's step alike. With d = 1
(no `experts -> AXIS`: every rank holds every expert) a rank gets all of its pairs whatever F, so
skew changes no rank's memory or step; only a capacity then drops pairs the busiest expert cannot take.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codes import W0807
from meshllm_dsl.diagnostics import Diagnostic
from meshllm_dsl.ir import DTYPES, PlanIR, Repeat, Unit
from meshllm_dsl.parallel.costs import (
    HeldUnit,
    Matmul,
    expert_degree,
    matmul_seconds,
    routed_pairs,
    routed_tokens,
)
from meshllm_dsl.planner.formatting import fmt_bytes, fmt_seconds, table_text
from meshllm_dsl.planner.held import held_units
from meshllm_dsl.planner.records import PlanReport
from meshllm_dsl.planner.spans import find_word, header_span

SKEW_WAIT_WARN = 0.10  # warn when the other expert-parallel ranks idle more than this share of the step


def rank_shares(skew: float, experts: int, degree: int) -> tuple[float, float]:
    """(busiest rank's, each other rank's) share of an expert-parallel group's routed pairs (no
    other rank at degree 1: 0)."""
    local = experts // degree
    rest = (1.0 - skew) / (experts - 1) if experts > 1 else 0.0
    return skew + (local - 1) * rest, local * rest if degree > 1 else 0.0


def rank_pairs(skew: float, experts: int, degree: int, pairs: int, capacity_each: int | None) -> tuple[float, float]:
    """(busiest rank's, each other rank's) pairs of a group whose ranks route `pairs` each, with a
    per-expert cap (`capacity_each`: per source rank; None: dropless)."""
    group = degree * pairs
    local = experts // degree
    busiest_expert, other_expert = skew * group, ((1.0 - skew) / (experts - 1) if experts > 1 else 0.0) * group
    if capacity_each is not None:
        cap = degree * capacity_each
        busiest_expert, other_expert = min(busiest_expert, cap), min(other_expert, cap)
    return busiest_expert + (local - 1) * other_expert, local * other_expert if degree > 1 else 0.0


def moe_units(plan: PlanIR) -> Iterator[tuple[Unit, int]]:
    """Each moe unit of the model with its count of copies (blocks)."""
    for item in plan.model.items:
        units, count = (item.body, item.count) if isinstance(item, Repeat) else ((item,), 1)
        for unit in units:
            if primitives.of(unit).routes_experts:
                yield unit, count


def active_parameters(plan: PlanIR) -> int:
    """Parameters one token uses: the model less each moe layer's experts it is not routed to
    (experts - top_k of them); the router and a shared expert are active for every token."""
    total = plan.model.numel
    for unit, count in moe_units(plan):
        e, k = int(unit.attr("experts")), int(unit.attr("top_k"))  # type: ignore[arg-type]
        per_expert = sum(lf.numel for lf in unit.leaves if lf.name in ("gate", "up", "down")) // e
        total -= count * (e - k) * per_expert
    return total


def router_statistics_bytes(plan: PlanIR) -> int:
    """Bytes of the routing statistics each pipeline transfer carries beside the activations when a
    moe layer asks for a router loss (runtime/train/program.py): 2 E + 3 floats per microbatch, in fp32
    (fp64 for an fp64 model), forward and as their gradient backward; 0 otherwise."""
    asking = [unit for unit, _ in moe_units(plan)
              if unit.attr("aux_loss_coef") or unit.attr("z_loss_coef") or unit.attr("seq_aux_loss")]
    if not asking or not plan.roles.pipeline:
        return 0
    return (2 * int(asking[0].attr("experts")) + 3) * max(4, DTYPES[plan.dtype])  # type: ignore[arg-type]


@attrs.frozen
class SkewRank:
    """One expert-parallel rank role at one pipeline coordinate under the plan's skew."""

    coord: int  # pipeline coordinate
    role: str  # "busiest" (holds the busiest expert) or "others"
    pairs: float  # routed pairs per moe layer and microbatch it computes
    balanced_pairs: int
    received_rows: float  # of those, rows the dispatch all-to-all brings from the other ranks
    peak_bytes: int  # training peak under the skew
    step_s: float  # its busy time in the step: the planned step plus its extra expert work
    wait_s: float  # time it idles for the busiest rank per step


@attrs.frozen
class SkewReport:
    skew: float
    degree: int
    experts: int
    dropped_share: float  # of the routed pairs, dropped by a capacity under the skew (0: dropless)
    ranks: tuple[SkewRank, ...]
    step_s: float  # the step under the skew: the busiest rank's
    balanced_step_s: float
    a2a_factor: float = 1.0  # each expert all-to-all's time against balanced routing (the busiest rank's rows)
    a2a_extra_s: float = 0.0  # what that adds to every rank's step

    @property
    def wait_share(self) -> float:
        return max((r.wait_s for r in self.ranks), default=0.0) / self.step_s if self.step_s else 0.0


def _expert_saved_bytes(plan: PlanIR, hu: HeldUnit, pairs: float) -> float:
    """Saved activations that scale with a rank's routed pairs (the moe primitive's routed terms)."""
    e = DTYPES[plan.dtype]
    hid = int(hu.unit.attr("hidden"))  # type: ignore[arg-type]
    f = _ffn_local(plan, hu)
    return pairs * e * (2 * hid + 4 * f)


def received_rows(pairs: float, degree: int) -> float:
    """Rows of a rank's `pairs` (per layer and microbatch) the dispatch all-to-all brings from the
    other ranks of its expert group: every source routes alike, so 1 / degree of them are its own."""
    return pairs * (degree - 1) / degree


def _held_copies(plan: PlanIR, hu: HeldUnit, in_flight: int) -> int:
    """Copies of the layer's saved activations at the peak: one per block and microbatch in flight,
    but `recompute = blocks` keeps none for a recomputed block beyond the one being recomputed."""
    if plan.recompute != "blocks":
        return in_flight * hu.count
    every = plan.recompute_every
    recomputed = sum(1 for i in hu.indices if (i + 1) % every == 0) if hu.indices else hu.count
    return in_flight * (hu.count - recomputed) + (1 if recomputed else 0)


def _ffn_local(plan: PlanIR, hu: HeldUnit) -> int:
    leaf = next(lf for lf in hu.unit.leaves if lf.name == "gate")
    return plan.local_shape(leaf.params[0], hu.placement(leaf))[0]


def _expert_seconds(rep: PlanReport, hu: HeldUnit, pairs: float) -> float:
    """Forward and backward (3x the forward) of the experts' three matmuls over `pairs` pairs."""
    plan, e = rep.plan, DTYPES[rep.plan.dtype]
    hid, f, n = int(hu.unit.attr("hidden")), _ffn_local(plan, hu), max(1, round(pairs))  # type: ignore[arg-type]
    return 3 * (matmul_seconds(rep.device, Matmul(n, f, hid, 2), e)
                + matmul_seconds(rep.device, Matmul(n, hid, f), e))


def skew_report(rep: PlanReport) -> SkewReport | None:
    """Each pipeline coordinate's busiest and other expert-parallel ranks under `skew` (None
    without `skew`)."""
    plan = rep.plan
    if plan.skew is None:
        return None
    skew, m = plan.skew, plan.microbatches
    # a rank's tokens of a microbatch: s / c of each sequence under context parallelism
    rank_tokens = rep.micro_batch * plan.seq // plan.context_size
    rows: list[SkewRank] = []
    degree, experts, routed, computed = 1, 0, 0.0, 0.0
    extra_busiest = a2a_extra = 0.0
    a2a_factor = 1.0
    for rc in rep.ranks:
        busy_bytes = other_bytes = 0.0
        busy_s = other_s = 0.0
        balanced = 0
        for stage in (s for s in plan.stages if s.index in rc.stages):
            for hu in held_units(plan, stage):
                if not primitives.of(hu.unit).routes_experts:
                    continue
                experts, k = int(hu.unit.attr("experts")), int(hu.unit.attr("top_k"))  # type: ignore[arg-type]
                cap = float(hu.unit.attr("capacity") or 0.0)  # type: ignore[arg-type]
                degree = expert_degree(plan, hu)
                tokens = routed_tokens(plan, hu, rank_tokens)  # its share over the experts' tensor axes
                balanced = routed_pairs(tokens, k, experts, cap)
                each = math.ceil(cap * tokens * k / experts) if cap else None
                busiest, other = rank_pairs(skew, experts, degree, tokens * k, each)
                routed += hu.count * degree * tokens * k
                computed += hu.count * (busiest + (degree - 1) * other)
                held = _held_copies(plan, hu, rc.in_flight)
                busy_bytes += held * (_expert_saved_bytes(plan, hu, busiest) - _expert_saved_bytes(plan, hu, balanced))
                other_bytes += held * (_expert_saved_bytes(plan, hu, other) - _expert_saved_bytes(plan, hu, balanced))
                base = _expert_seconds(rep, hu, balanced)
                busy_s += m * hu.count * (_expert_seconds(rep, hu, busiest) - base)
                other_s += m * hu.count * (_expert_seconds(rep, hu, other) - base)
        if not balanced:
            continue
        # The expert all-to-alls last as long as the busiest rank's rows: every rank's step grows.
        factor = busiest / balanced if degree > 1 else 1.0
        a2a = (factor - 1.0) * sum(c.seconds for c in rc.comms if c.kind == "expert")
        step = rep.step.total_s + a2a
        rows.append(SkewRank(rc.coord, "busiest", busiest, balanced, received_rows(busiest, degree),
                             round(rc.training_bytes + busy_bytes), step + busy_s, 0.0))
        if degree > 1:
            rows.append(SkewRank(rc.coord, "others", other, balanced, received_rows(other, degree),
                                 round(rc.training_bytes + other_bytes), step + other_s, busy_s - other_s))
        extra_busiest = max(extra_busiest, busy_s + a2a)
        a2a_factor, a2a_extra = max(a2a_factor, factor), max(a2a_extra, a2a)
    if not rows:
        return None
    return SkewReport(skew, degree, experts, 1.0 - computed / routed if routed else 0.0, tuple(rows),
                      rep.step.total_s + extra_busiest, rep.step.total_s, a2a_factor, a2a_extra)


def skew_lines(rep: PlanReport) -> list[str]:
    """The plan report's section on the skew (none without `skew`)."""
    sk = skew_report(rep)
    if sk is None:
        return []
    lines = ["", f"routing skew {sk.skew:g} (the busiest of {sk.experts} experts takes {sk.skew:.0%} of each moe layer's "
             f"routed tokens; expert-parallel degree {sk.degree})"]
    if sk.degree == 1:
        lines.append("  every rank holds every expert, so the skew moves no work between ranks"
                     + ("" if sk.dropped_share else ": no rank's memory or step changes"))
    if sk.a2a_factor > 1.0:
        lines.append(f"  each expert all-to-all takes {sk.a2a_factor:.2f}x its balanced time (the busiest rank receives "
                     f"that many times its balanced rows), {fmt_seconds(sk.a2a_extra_s)} more per step on every rank")
    if sk.dropped_share:
        lines.append(f"  capacity drops {sk.dropped_share:.1%} of the routed pairs under this skew (each expert takes at "
                     "most its capacity), so the ranks compute and save less than balanced")
    rows = [[str(r.coord), r.role, f"{r.pairs:,.0f}", f"{r.balanced_pairs:,}", f"{r.received_rows:,.0f}",
             fmt_bytes(r.peak_bytes),
             "yes" if r.peak_bytes <= rep.device.memory_bytes else "NO", fmt_seconds(r.step_s),
             fmt_seconds(r.wait_s)] for r in sk.ranks]
    lines += ["  " + x for x in table_text(
        ["pp", "ep rank", "pairs / layer / mb", "balanced", "rows in", "peak", "fits", "busy", "waits"], rows,
        right={2, 3, 4, 5, 7, 8})]
    return lines


def skew_warnings(rep: PlanReport) -> list[Diagnostic]:
    """W0807: under the plan's skew a rank does not fit, or the others wait more than
    SKEW_WAIT_WARN of the step."""
    sk = skew_report(rep)
    if sk is None:
        return []
    where = find_word(rep.plan.span, "skew") or header_span(rep.plan.span)
    out = []
    dev = rep.device
    worst = max(sk.ranks, key=lambda r: r.peak_bytes)
    if worst.peak_bytes > dev.memory_bytes and rep.peak_training_bytes <= dev.memory_bytes:
        out.append(Diagnostic(
            W0807, f"under skew {sk.skew:g} the {worst.role} expert-parallel rank at pipeline rank {worst.coord} needs "
            f"{fmt_bytes(worst.peak_bytes)}, {fmt_bytes(worst.peak_bytes - dev.memory_bytes)} more than "
            f"the {fmt_bytes(dev.memory_bytes)} of a {dev.name}", where,
            label="does not fit under this routing skew",
            help="set a capacity factor on the model (`capacity = 1.25`) so no expert takes more than its share, or "
            "raise the load-balancing loss (`aux_loss_coef`)"))
    if sk.wait_share > SKEW_WAIT_WARN:
        wait = max(r.wait_s for r in sk.ranks)
        out.append(Diagnostic(
            W0807, f"under skew {sk.skew:g} the other expert-parallel ranks wait {fmt_seconds(wait)} per step for "
            f"the busiest, {sk.wait_share:.0%} of the {fmt_seconds(sk.step_s)} step"
            + (f"; its all-to-alls take {sk.a2a_factor:.2f}x their balanced time (the busiest rank receives "
               f"{max(r.received_rows for r in sk.ranks):,.0f} rows per layer and microbatch from the others, "
               f"{received_rows(sk.ranks[0].balanced_pairs, sk.degree):,.0f} balanced)" if sk.a2a_factor > 1.0 else ""),
            where,
            label=f"more than {SKEW_WAIT_WARN:.0%} of the step idle",
            help="set a capacity factor (`capacity = 1.25`) or raise `aux_loss_coef`; `meshc run --profile` prints the "
            "measured busiest share to put here"))
    return out
