"""The plan pass: settings, then each rule pass in order (placements, stages, batch and schedule,
optimizer, memory techniques, pitfalls), then the checked PlanIR."""

from __future__ import annotations

from meshllm_dsl import ast
from meshllm_dsl.checker.batch import BatchRules
from meshllm_dsl.checker.memory import MemoryRules
from meshllm_dsl.checker.optimizer import OptimizerRules
from meshllm_dsl.checker.pitfalls import PitfallRules
from meshllm_dsl.checker.placements import PlacementRules
from meshllm_dsl.checker.stages import StageRules
from meshllm_dsl.codes import E0203, E0309
from meshllm_dsl.diagnostics import typo
from meshllm_dsl.ir import PlanIR, Unit
from meshllm_dsl.layouts import top_flows
from meshllm_dsl.names import or_list
from meshllm_dsl.resolve import Binding
from meshllm_dsl.roles import ParallelRoles, split_axes

PLAN_SETTINGS = ("batch", "seq", "microbatches", "dtype", "recompute")
# Settings the language used to accept that nothing downstream reads: refused until they are honoured.
UNSUPPORTEDPLAN_SETTINGS = {
    "seed": "the seed is chosen at launch: `meshc run FILE --seed N` (or `--seed N` on the generated module)",
    "lr": "set the learning rate on the optimizer: `optimizer adamw { lr = 0.001 }`",
}


class PlanChecker(PlacementRules, StageRules, BatchRules, OptimizerRules, MemoryRules, PitfallRules):
    # -- entry point
    def check(self) -> PlanIR | None:
        decl = self.decl
        settings: dict[str, ast.Setting] = {}
        for stmt in decl.body:
            if not isinstance(stmt, ast.Setting):
                continue
            if stmt.name.value in settings:
                self.repeated(f"plan setting `{stmt.name.value}`", stmt.name.span, settings[stmt.name.value].name.span)
                continue
            settings[stmt.name.value] = stmt
        env: dict[str, Binding] = {}  # plan settings are literals or arithmetic on literals
        values: dict[str, int] = {}
        for key, s in settings.items():
            if key in UNSUPPORTEDPLAN_SETTINGS:
                self.error(E0309, f"plan setting `{key}` is not supported yet", s.name.span,
                           label="would be ignored", help=UNSUPPORTEDPLAN_SETTINGS[key])
                continue
            if key not in PLAN_SETTINGS:
                self.error(E0203, f"unknown plan setting `{key}`", s.name.span, label="not a plan setting",
                           **typo(s.name.span, key, PLAN_SETTINGS))
                continue
            if key in ("dtype", "recompute"):
                continue
            v = self.eval_int(s.value, env, key)
            if v is not None:
                values[key] = v
            else:
                self.bad_settings.add(key)
        dtype = self.model.dtype
        if "dtype" in settings:
            v = settings["dtype"].value
            from meshllm_dsl.ir import DTYPES

            if isinstance(v, ast.Name) and v.value in DTYPES:
                dtype = v.value
            else:
                self.error(E0203, "unknown dtype", v.span, label="not a dtype", help=f"use one of {or_list(DTYPES)}")

        recompute = self.recompute(settings.get("recompute"))

        batch_axes, layout_matches = self.layout()
        matches = self.shard_rules(layout_matches)
        top, classes = self.placements(matches)
        loss = self.loss(top)
        stages, pipeline_axis, virtual = self.stages(top, classes)
        schedule = self.schedule(pipeline_axis, virtual)
        microbatches = values.get("microbatches", 1)
        batch = values.get("batch", max(1, microbatches) * (self.mesh.size(*batch_axes) if batch_axes else 1))
        # Unset, seq is 128, or the positions a model with learned positions has when it has fewer.
        limits = [int(i.attr("num")) for i in self.model.items if isinstance(i, Unit) and i.kind == "positional"]  # type: ignore[arg-type]
        seq = values.get("seq", min([128, *limits]))
        if "seq" not in self.bad_settings:
            self.positions(seq, settings.get("seq"))
        self.batch_checks(batch, microbatches, batch_axes, settings, stages, schedule)
        self.sequence_parallel(seq, settings.get("seq"))
        optimizer, opt_settings, zero, zero_axes = self.optimizer(batch_axes)
        dtype, master_dtype, reduce_dtype = self.precision(dtype, zero, "dtype" in settings)
        self.axis_usage(top, classes, pipeline_axis, batch_axes)
        if not self.failed:
            self.sharding_warnings(top, classes)
        if self.failed:
            return None
        roles = ParallelRoles(
            pipeline=pipeline_axis, batch=batch_axes, batch_shard=zero_axes if zero else (),
            tensor=split_axes(self.mesh, [*top.values(), *(p for c in classes for _, p in c.placements)]),
            sequence=self.seq_axes, loss=loss.axes if loss.sharded else (),
        )
        return PlanIR(
            name=decl.name.value, mesh=self.mesh, model=self.model, batch=batch, seq=seq,
            microbatches=microbatches, schedule=schedule, virtual=virtual, roles=roles,
            stages=stages, top_placements=tuple(top.items()),
            top_flows=tuple(top_flows(self.model, top, loss, self.seq_axes)), block_classes=classes,
            optimizer=optimizer, optimizer_settings=opt_settings, zero=zero,
            dtype=dtype, master_dtype=master_dtype, reduce_dtype=reduce_dtype, recompute=recompute,
            span=decl.span,
        )
