"""One plan checked: the passes of checker/passes.py in order, then the checked PlanIR."""

from __future__ import annotations

from collections.abc import Iterable

from meshllm_dsl.checker.passes import (
    PLAN_SETTINGS,
    UNSUPPORTEDPLAN_SETTINGS,
    PassContext,
    run_passes,
)
from meshllm_dsl.diagnostics import Diagnostic
from meshllm_dsl.front import ast
from meshllm_dsl.ir import MeshIR, ModelIR, Placement, PlanIR
from meshllm_dsl.parallel.devices import DeviceProfile
from meshllm_dsl.parallel.layouts import top_flows
from meshllm_dsl.parallel.roles import ParallelRoles

__all__ = ["PLAN_SETTINGS", "UNSUPPORTEDPLAN_SETTINGS", "PlanChecker", "plan_ir"]


class PlanChecker:
    """Runs every pass over one plan, adds their diagnostics to `diags`; the PlanIR if none is an error."""

    def __init__(self, decl: ast.PlanDecl, mesh: MeshIR, model: ModelIR, diags: list[Diagnostic],
                 per_host: int | None = None, profile: DeviceProfile | None = None) -> None:
        self.context = PassContext(decl, mesh, model, per_host, profile)
        self.diagnostics = diags

    def check(self) -> PlanIR | None:
        done = run_passes(self.context)
        for _name, result in done.results:
            self.diagnostics.extend(result.diagnostics)
        return None if done.failed else plan_ir(done)


def plan_ir(ctx: PassContext) -> PlanIR:
    """The checked plan from the results of every pass (of a plan with no errors)."""
    top, classes, loss, zero = ctx["top"], ctx["classes"], ctx["loss"], ctx["zero"]
    roles = ParallelRoles(
        pipeline=ctx["pipeline_axis"], batch=ctx["batch_axes"], batch_shard=ctx["zero_axes"] if zero else (),
        tensor=split_axes(ctx.mesh, [*top.values(), *(p for c in classes for _, p in c.placements)]),
        sequence=ctx["seq_axes"], loss=loss.axes if loss.sharded else (), context=ctx["context_axes"],
        expert=ctx["expert_axes"],
    )
    return PlanIR(
        name=ctx.decl.name.value, mesh=ctx.mesh, model=ctx.model, batch=ctx["batch"], seq=ctx["seq"],
        microbatches=ctx["microbatches"], schedule=ctx["schedule"], virtual=ctx["virtual"], roles=roles,
        stages=ctx["stages"], top_placements=tuple(top.items()),
        top_flows=tuple(top_flows(ctx.model, top, loss, ctx["seq_axes"])), block_classes=classes,
        optimizer=ctx["optimizer"], optimizer_settings=ctx["optimizer_settings"], zero=zero,
        dtype=ctx["dtype"], master_dtype=ctx["master_dtype"], reduce_dtype=ctx["reduce_dtype"],
        recompute=ctx["recompute"], recompute_every=ctx["recompute_every"], skew=ctx["skew"],
        float8=ctx["float8"], compile=ctx["compile"], document_mask=ctx["document_mask"],
        restart_positions=ctx["restart_positions"], context_balance=ctx["context_balance"], span=ctx.decl.span,
    )


def split_axes(mesh: MeshIR, placements: Iterable[Placement]) -> tuple[str, ...]:
    """The axes, in mesh order, that any of `placements` splits a parameter over:
    a plan's tensor axes."""
    used = {a for p in placements if p.sharded for a in p.axes}
    return tuple(a.name for a in mesh.axes if a.name in used)
