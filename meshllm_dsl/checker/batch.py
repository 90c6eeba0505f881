"""Batch, sequence and schedule: batch splits over the data axes and microbatches (E0305), the schedule
fits the stage map (E0606, E0607, W0703), seq within learned positions (E0310)."""

from __future__ import annotations

from collections.abc import Sequence

from meshllm_dsl import primitives
from meshllm_dsl.checker.context import (
    PlanContext,
)
from meshllm_dsl.codes import E0305, E0310, E0606, E0607, W0703
from meshllm_dsl.diagnostics import Label, Suggestion, replace, typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.names import or_list
from meshllm_dsl.ir import (
    SCHEDULE_VIRTUAL,
    SCHEDULES,
    Stage,
    Unit,
    takes_microbatches,
    zero_bubble_rounds,
)


class BatchRules(PlanContext):
    def schedule(self, pipeline_axis: str | None, virtual: int) -> str:
        stmt = self.single(ast.ScheduleStmt, "`schedule`")
        default = "interleaved_1f1b" if virtual > 1 else ("1f1b" if pipeline_axis else "gpipe")
        if stmt is None:
            return default
        name = stmt.name.value
        if name not in SCHEDULES:
            self.error(E0607, f"unknown schedule `{name}`", stmt.name.span, label="not a schedule",
                       **typo(stmt.name.span, name, SCHEDULES))
            # The checks that read the schedule would judge the default in its place, not the plan.
            self.bad_settings.add("schedule")
            return default
        runs = SCHEDULE_VIRTUAL[name]  # stages per rank torch's class for it runs
        if runs == "many" and virtual < 2:
            self.error(E0607, "`interleaved_1f1b` needs virtual stages", stmt.name.span, label="no `virtual N` on the stages",
                       help="write `stages over AXIS virtual 2 ...` (each rank then runs 2 stages)")
        if runs == "one" and virtual > 1:
            self.error(E0607, f"virtual stages need the `interleaved_1f1b` schedule, not `{name}`", stmt.name.span,
                       label="does not interleave", help="use `schedule interleaved_1f1b`, or drop `virtual`")
        if runs == "two" and virtual != 2:
            # ZBV and DualPipeV run a V: two stages on every rank, one on the way down, one back up.
            self.error(E0607, f"`{name}` runs exactly 2 stages per rank (a V), not {virtual}", stmt.name.span,
                       label=f"{virtual} stage{'s' if virtual != 1 else ''} per rank",
                       help="write `stages over AXIS virtual 2 ...`: rank r then holds stages r and 2p - 1 - r")
        if runs != "one" and not pipeline_axis:
            self.error(E0607, f"`{name}` is a pipeline schedule, and this plan has no pipeline stages", stmt.name.span,
                       label="nothing to schedule", help="add `stages over AXIS ...`, or drop the `schedule`")
        return name

    def batch_checks(self, batch: int, micro: int, batch_axes: tuple[str, ...], settings: dict[str, ast.Setting],
                     stages: Sequence[Stage], schedule: str) -> None:
        dp = self.mesh.size(*batch_axes) if batch_axes else 1
        span = settings["batch"].value.span if "batch" in settings else self.decl.name.span
        if self.bad_settings & {"batch", "microbatches"}:
            return  # a rejected value (reported): checks on a default in its place would mislead
        if batch % (dp * micro):
            parts = " x ".join([*(f"{a} ({self.mesh.size(a)})" for a in batch_axes), f"microbatches ({micro})"])
            ok = [b for b in range(dp * micro, dp * micro * 5, dp * micro)]
            self.error(E0305, f"batch {batch} does not split into {parts}", span,
                       label=f"not a multiple of {dp * micro}",
                       secondary=(Label(settings["microbatches"].value.span, "microbatches here"),) if "microbatches" in settings and settings["microbatches"].value.span else (),  # type: ignore[arg-type]
                       help=f"batch must be a multiple of {dp * micro}: e.g. {or_list(ok)}",
                       suggestions=_values(settings.get("batch"), ok))
        pipeline = len({s.coord for s in stages})
        if "schedule" in self.bad_settings:
            return
        if pipeline > 1 and micro < pipeline:
            ms = settings.get("microbatches")
            where = ms.value.span if ms is not None else self.decl.name.span
            if schedule in ("1f1b", "interleaved_1f1b"):  # (dualpipev: below, against the stage count)
                self.error(E0606, f"`{schedule}` needs at least as many microbatches as pipeline stages ({micro} < {pipeline})",
                           where, label=f"{micro} microbatch{'es' if micro != 1 else ''}" if ms is not None else "`microbatches` is not set (so 1)",
                           help=f"{'use' if ms is not None else 'set'} `microbatches = {pipeline}` or more (and batch divisible by it)",
                           suggestions=_values(ms, [pipeline], "microbatches"),
                           note="with fewer microbatches than stages 1F1B cannot fill the pipeline and hangs in torch")
            elif schedule == "gpipe":
                self.warn(W0703, f"{micro} microbatches for {pipeline} pipeline stages", where,
                          label="fewer microbatches than stages",
                          help=f"use at least {pipeline} (bubble is (p - 1) / (m + p - 1) = {(pipeline - 1) / (micro + pipeline - 1):.0%} now)")
            elif schedule != "dualpipev":
                self.warn(W0703, f"{micro} microbatches for {pipeline} pipeline ranks", where,
                          label="fewer microbatches than ranks",
                          help=f"use at least {pipeline}: with fewer, `{schedule}` never fills the pipeline")
        ms = settings.get("microbatches")
        where = ms.value.span if ms is not None else self.decl.name.span
        refused = pipeline > 1 and not takes_microbatches(schedule, pipeline, len(stages), micro)
        if schedule == "dualpipev" and refused:
            # torch's ScheduleDualPipeV refuses it: both directions of the V must be full at once.
            self.error(E0606, f"`dualpipev` needs at least as many microbatches as stages ({micro} < {len(stages)})",
                       where, label=f"{micro} microbatch{'es' if micro != 1 else ''}" if ms is not None else "`microbatches` is not set (so 1)",
                       help=f"{'use' if ms is not None else 'set'} `microbatches = {len(stages)}` or more (and batch divisible by it)",
                       suggestions=_values(ms, [len(stages)], "microbatches"))
        rounds = zero_bubble_rounds(pipeline, micro)
        if schedule == "interleaved_zb" and refused:
            fits = [k for k in range(max(1, micro - 2 * pipeline), micro + 2 * pipeline + 1)
                    if takes_microbatches(schedule, pipeline, len(stages), k)]
            near = sorted(fits, key=lambda k: (abs(k - micro), k))[:3]
            self.error(E0606, f"`interleaved_zb` runs whole rounds of {rounds} microbatches, and {micro} is not a multiple of {rounds}",
                       where, label=f"{micro} microbatches",
                       help=f"use {or_list(sorted(near))} microbatches: each round runs m // {pipeline} of them, so m must be a multiple of that",
                       suggestions=_values(ms, sorted(near), "microbatches"))
        if schedule == "interleaved_1f1b" and pipeline > 1 and micro % pipeline:
            ms = settings.get("microbatches")
            self.error(E0606, f"`interleaved_1f1b` needs microbatches divisible by the pipeline size ({micro} % {pipeline} != 0)",
                       ms.value.span if ms is not None else self.decl.name.span, label=f"{micro} microbatches",
                       help=f"use a multiple of {pipeline}")

    def positions(self, seq: int, given: ast.Setting | None) -> None:
        """Learned positions have a table of `num` rows: a longer sequence would index past it."""
        for item in self.model.items:
            limit = primitives.of(item).position_limit(item) if isinstance(item, Unit) else None
            if limit is not None and seq > limit:
                num = item.attr("num")
                self.error(E0310, f"seq {seq} is longer than the {num} positions of `{item.name}`",
                           given.value.span if given is not None else self.decl.name.span,
                           label=f"seq = {seq}" if given is not None else f"`seq` is not set (so {seq})",
                           secondary=(Label(item.span, f"{num} learned positions"),) if item.span else (),
                           help=f"{'use' if given is not None else 'set'} `seq = {num}` or less, or give the model more positions",
                           suggestions=_values(given, [int(num)], "seq"))


def _values(given: ast.Setting | None, values: Sequence[int], name: str | None = None) -> tuple[Suggestion, ...]:
    """Setting a written value to each of `values` (nothing for a setting left unset: where to add
    it is a choice the plan's author makes)."""
    if given is None:
        return ()
    return tuple(s for v in values
                 for s in replace(given.value.span, str(v), f"Use `{name} = {v}`" if name else f"Use {v}"))
