"""The plan's warnings W0801 - W0807 (the seed's pitfalls, with numbers): WARNINGS holds one function
per code in the order `meshc plan` prints them, and plan_warnings runs them on an analysed plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from meshllm_dsl.codes import W0801, W0802, W0803, W0804, W0805, W0806
from meshllm_dsl.diagnostics import Diagnostic, Label
from meshllm_dsl.ir import placement_of, takes_microbatches
from meshllm_dsl.parallel.costs import MFU
from meshllm_dsl.planner.comm import axes_cross_hosts
from meshllm_dsl.planner.formatting import fmt_bytes, fmt_count, fmt_seconds
from meshllm_dsl.planner.formulas import bubble_formula, bubble_fraction
from meshllm_dsl.planner.records import PlanReport, RankClass, StepTime
from meshllm_dsl.planner.spans import find_word, header_span

# ---------------------------------------------------------------- warnings (the seed's pitfalls, with numbers)

# Thresholds, each the point where the pitfall costs more than a typical plan tolerates.
BUBBLE_WARN = 0.2  # more than a fifth of the step idle in the pipeline
IMBALANCE_WARN = 1.25  # as the checker's W0701 for parameters: the busiest stage sets the pace


def _comm_help(step: StepTime) -> str:
    """W0803's help: what raises the compute per byte moved, for the collectives the step has,
    the largest first (a plan without a tensor axis is never told to shrink one)."""
    remedies = {
        "tensor": "fewer tensor-parallel devices or larger microbatches",
        "pipeline": "larger microbatches (fewer, bigger pipeline transfers) or fewer pipeline stages",
        "data": "more sequences per data replica (a larger batch or fewer replicas)",
        "expert": "fewer expert-parallel ranks (the all-to-all moves top_k rows per token whatever the batch)",
        "context": "fewer context-parallel ranks (each gathers every rank's keys and values per layer)",
    }
    parts = sorted(((step.tensor_s, "tensor"), (step.expert_s, "expert"), (step.pipeline_s, "pipeline"),
                    (step.data_s, "data"), (step.context_s, "context")), reverse=True)
    named = [remedies[kind] for seconds, kind in parts if seconds > 0]
    return f"{'; or '.join(named) or 'larger microbatches'} raise the compute per byte moved"


def _fullest(report: PlanReport) -> RankClass:
    """The rank class needing the most memory in training."""
    return max(report.ranks, key=lambda r: r.training_bytes)


def _memory_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0801: the plan does not fit, with what takes the most of the fullest rank's memory."""
    if report.fits:
        return []
    plan, dev, worst = report.plan, report.device, _fullest(report)
    mesh_dev = find_word(plan.mesh.span, "device")
    dev_label = (Label(mesh_dev, f"{dev.name}: {dev.memory_gib:g} GiB, {dev.tflops:g} TFLOP/s"),) if mesh_dev else ()
    parts = {"weights": worst.weight_bytes, "gradients": worst.grad_bytes, "optimizer states": worst.optimizer_bytes,
             "activations": worst.activation_bytes, "ZeRO-3 gather buffer": worst.gather_buffer_bytes,
             "gradient accumulators": worst.grad_accum_bytes}
    biggest = max(parts, key=lambda k: parts[k])
    return [Diagnostic(
        W0801, f"plan `{plan.name}` needs {fmt_bytes(worst.training_bytes)} on pipeline rank {worst.coord}, "
        f"more than the {fmt_bytes(dev.memory_bytes)} of a {dev.name}", header_span(plan.span),
        label="does not fit in device memory", secondary=dev_label,
        note="per device: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items() if v),
        help=_fit_help(report, biggest))]


def _over_sharding_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0802: the last doubling of a sharding axis costs more communication than it saves."""
    plan, dev, out = report.plan, report.device, []
    for axis, comm_s in _tensor_comm_by_axis(report).items():
        size = plan.mesh.size(axis)
        slow = max(report.ranks, key=lambda r: r.compute_s)
        sharded = slow.params_local - slow.params_replicated
        saved = 6 * sharded * (plan.batch // plan.data_size) * plan.seq / (dev.tflops * 1e12 * (dev.mfu or MFU))
        half = size // 2
        kept = comm_s * ((half - 1) / half) / ((size - 1) / size) if half > 1 else 0.0
        if size > 1 and comm_s - kept > saved:
            ax = plan.mesh.axis(axis)
            out.append(Diagnostic(
                W0802, f"`{axis}` = {size} over-shards: {fmt_count(slow.params_local)} parameters per device cost "
                f"{fmt_seconds(comm_s)} of collectives per step", ax.span if ax else header_span(plan.span),
                label=f"halving it would save {fmt_seconds(comm_s - kept)} of communication for {fmt_seconds(saved)} more compute",
                help=f"use `{axis}` = {half} and give the devices to data parallelism, if it still fits in memory "
                "(`meshc suggest` searches the alternatives)",
                note="each tensor-parallel layer all-reduces its activations; below a few thousand columns per "
                "device the matmul is too small to hide it"))
    return out


def _communication_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0803: the step spends more time communicating than computing."""
    step = report.step
    if step.comm_s <= step.compute_s:
        return []
    return [Diagnostic(
        W0803, f"communication ({fmt_seconds(step.comm_s)}) exceeds compute ({fmt_seconds(step.compute_s)}) per step",
        header_span(report.plan.span), label="communication-dominated",
        note=f"tensor {fmt_seconds(step.tensor_s)}, "
        + (f"expert {fmt_seconds(step.expert_s)}, " if step.expert_s else "")
        + f"pipeline {fmt_seconds(step.pipeline_s)}, data {fmt_seconds(step.data_s)}",
        help=_comm_help(step))]


def _network_tensor_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0804: a tensor axis runs over the inter-host link, with its cost."""
    plan, dev, out = report.plan, report.device, []
    for axis, comm_s in _tensor_comm_by_axis(report).items():
        if axes_cross_hosts(plan.mesh, (axis,)):
            intra = comm_s * dev.inter_gbps / dev.intra_gbps
            ax = plan.mesh.axis(axis)
            out.append(Diagnostic(
                W0804, f"tensor-parallel axis `{axis}` runs its collectives over the network: "
                f"{fmt_seconds(comm_s)} per step", ax.span if ax else header_span(plan.span),
                label=f"about {fmt_seconds(intra)} within a host ({dev.inter_gbps:g} vs {dev.intra_gbps:g} GB/s)",
                help=f"put `{axis}` last in `axes` and keep it at most {plan.mesh.devices_per_host} (devices per host)"))
    return out


def _bubble_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0805: a large pipeline bubble, with the microbatches that would shrink it."""
    if report.bubble <= BUBBLE_WARN:
        return []
    plan = report.plan
    p, m = plan.pipeline_size, plan.microbatches
    where = find_word(plan.span, "microbatches") or header_span(plan.span)
    if plan.schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        need = math.ceil(9 * (p - 1) / plan.virtual)  # (p - 1) / (v (m + p - 1)) <= 10%, roughly
    else:
        # No closed form over m: the least m whose simulated order idles at most 10% (the same
        # order the report prices), searched over the microbatch counts torch's class accepts.
        need = next((k for k in range(m + 1, 64 * p + 1) if takes_microbatches(plan.schedule, p, len(plan.stages), k)
                     and bubble_fraction(plan.schedule, p, k, plan.virtual) <= BUBBLE_WARN), m)
    return [Diagnostic(
        W0805, f"the pipeline bubble is {report.bubble:.0%} of the step ({fmt_seconds(report.step.bubble_s)})", where,
        label=f"{m} microbatches over {p} stages",
        help=f"raise microbatches to about {need} or more (batch permitting) for a bubble near 10%"
        + (", or interleave: `stages over ... virtual 2` with `schedule interleaved_1f1b`" if plan.schedule in ("gpipe", "1f1b") else ""),
        note=f"bubble = {report.bubble:.3f}" + bubble_formula(plan, report.bubble))]


def _imbalance_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0806: one pipeline rank needs far more memory than another."""
    if len(report.ranks) <= 1:
        return []
    plan, worst = report.plan, _fullest(report)
    light = min(report.ranks, key=lambda r: r.training_bytes)
    if not (light.training_bytes and worst.training_bytes > IMBALANCE_WARN * light.training_bytes):
        return []
    where = find_word(plan.span, "stages") or header_span(plan.span)
    return [Diagnostic(
        W0806, f"pipeline rank {worst.coord} needs {worst.training_bytes / light.training_bytes:.2f}x the memory "
        f"of rank {light.coord} ({fmt_bytes(worst.training_bytes)} vs {fmt_bytes(light.training_bytes)})", where,
        label="stage memory imbalance",
        note="per pipeline rank: " + ", ".join(f"{r.coord}: {fmt_bytes(r.training_bytes)}" for r in report.ranks),
        help=f"move blocks off stage {worst.stages[0]}"
        + (" (1F1B keeps p - r microbatches of activations on rank r, so early stages should hold fewer blocks)"
           if plan.schedule in ("1f1b", "interleaved_1f1b") and worst.coord < light.coord else
           f" (`{plan.schedule}` puts the first and the last stage on rank 0: the embedding and the head are both there)"
           if placement_of(plan.schedule) == "v" and worst.coord == 0 else ""))]


def _skew_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0807: under the plan's routing skew the other expert-parallel ranks wait long."""
    from meshllm_dsl.planner import moe as planner_moe

    return planner_moe.skew_warnings(report)


# The plan's warnings (the seed's pitfalls, with numbers), in the order `meshc plan` prints them.
WARNINGS: tuple[Callable[[PlanReport], list[Diagnostic]], ...] = (
    _memory_warnings, _over_sharding_warnings, _communication_warnings, _network_tensor_warnings, _bubble_warnings,
    _imbalance_warnings, _skew_warnings,
)


def plan_warnings(report: PlanReport) -> list[Diagnostic]:
    """W0801 - W0807 for one analysed plan: WARNINGS in order."""
    return [d for warnings in WARNINGS for d in warnings(report)]


def _tensor_comm_by_axis(report: PlanReport) -> dict[str, float]:
    """Seconds per step of tensor-parallel collectives on the slowest rank, per sharding axis."""
    slow = max(report.ranks, key=lambda r: r.compute_s + r.comm_seconds(("tensor", "loss")))
    out: dict[str, float] = {}
    for c in slow.comms:
        if c.kind in ("tensor", "loss"):
            for a in c.axis.split(" x "):
                out[a] = out.get(a, 0.0) + c.seconds
    return out


def _fit_help(report: PlanReport, biggest: str) -> str:
    plan = report.plan
    if biggest == "optimizer states" and plan.data_size > 1 and plan.zero < 1:
        return (f"shard the optimizer states over the data axes: `optimizer adamw {{ zero 1 over "
                f"{' * '.join(plan.roles.batch)} }}` divides them by {plan.data_size}")
    if biggest == "activations" and plan.batch // (plan.data_size * plan.microbatches) > 1:
        return (f"more microbatches make each smaller: activations scale with the microbatch size "
                f"({report.micro_batch} sequences now)")
    path = plan.span.file if plan.span is not None else "FILE"
    return (f"shard over more devices (tensor or pipeline), or run `meshc suggest {path} --devices "
            f"{plan.mesh.devices} --device {report.device.name}` to search the plans that fit")
