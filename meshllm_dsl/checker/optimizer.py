"""The optimizer statement: its name and settings with their ranges (E0203, E0304, E0309) and ZeRO
over the data-parallel axes or a subset of them (E0407; a subset is HSDP, replicated over the rest):
stage 1 is torch's ZeroRedundancyOptimizer, 2 and 3 FSDP2."""

from __future__ import annotations

from meshllm_dsl.checker.context import (
    PlanContext,
)
from meshllm_dsl.codes import E0203, E0304, E0309, E0407
from meshllm_dsl.diagnostics import Applicability, replace, typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.names import or_list
from meshllm_dsl.ir import DTYPES

# `precision { matmul = R, all_gather = fp8 }`: read by checker/matmul.py.
MATMUL_KEYS = ("matmul", "all_gather")

OPT_SETTINGS = {
    "lr": (0.0, 1e3, True, False),
    "weight_decay": (0.0, 1e3, False, False),
    "beta1": (0.0, 1.0, False, True),
    "beta2": (0.0, 1.0, False, True),
    "eps": (0.0, 1.0, True, False),
    # The training loop's: clip the global gradient norm; linear warmup, then cosine decay to min_lr.
    "clip": (0.0, 1e6, True, False),
    "warmup": (0.0, 1e9, False, False),
    "decay_steps": (0.0, 1e9, False, False),
    "min_lr": (0.0, 1e3, False, False),
}
OPT_STEP_COUNTS = ("warmup", "decay_steps")
# `precision { params = bf16, master = fp32, reduce = fp32 }`: compute, master weights (and
# optimizer states), gradient reduction.
PRECISION_KEYS = ("params", "master", "reduce")


class OptimizerRules(PlanContext):
    def optimizer(self, batch_axes: tuple[str, ...], context_axes: tuple[str, ...] = ()
                  ) -> tuple[str, tuple[tuple[str, object], ...], int, tuple[str, ...]]:
        # Parameters are replicated over the batch axes and the context axes alike: ZeRO may shard
        # over any of them (torchtitan's FSDP over data x cp); by default over the batch axes.
        replica_axes = tuple(a.name for a in self.mesh.axes if a.name in batch_axes or a.name in context_axes)
        stmts = [s for s in self.decl.body if isinstance(s, ast.OptimizerStmt)]
        if not stmts:
            return "adamw", (), 0, ()
        stmt = stmts[0]
        for extra in stmts[1:]:
            self.repeated("`optimizer`", extra.span, stmt.span)
        if stmt.name.value in ("adam", "sgd"):
            self.error(E0309, f"optimizer `{stmt.name.value}` is not supported yet", stmt.name.span,
                       label="the runtime builds AdamW", help="use `optimizer adamw { ... }` (with `weight_decay = 0` "
                       "it is Adam with decoupled decay switched off)")
        elif stmt.name.value != "adamw":
            self.error(E0203, f"unknown optimizer `{stmt.name.value}`", stmt.name.span, label="not an optimizer",
                       help="use `adamw`")
        settings = []
        seen: dict[str, ast.Setting] = {}
        for s in stmt.settings:
            if s.name.value not in OPT_SETTINGS:
                self.error(E0203, f"unknown optimizer setting `{s.name.value}`", s.name.span, label="not a setting",
                           **typo(s.name.span, s.name.value, OPT_SETTINGS))
                continue
            if s.name.value in seen:
                self.repeated(f"optimizer setting `{s.name.value}`", s.name.span, seen[s.name.value].name.span)
                continue
            seen[s.name.value] = s
            low, high, low_open, high_open = OPT_SETTINGS[s.name.value]
            v = self.eval_float(s.value, {}, f"`{s.name.value}`", low, high, low_open, high_open)
            if v is not None and s.name.value in OPT_STEP_COUNTS and not float(v).is_integer():
                self.error(E0304, f"`{s.name.value}` is a number of steps, not {v}", s.value.span,
                           label="not a whole number", help=f"write `{s.name.value} = {int(v)}`")
                continue
            if v is not None:
                settings.append((s.name.value, v))
        zero, zero_axes = 0, ()
        if stmt.zero is not None:
            zero = stmt.zero.stage.value
            if zero not in (0, 1, 2, 3):
                self.error(E0203, f"ZeRO stage {zero} does not exist", stmt.zero.stage.span, label="not 0, 1, 2 or 3",
                           help="zero 1 shards optimizer states over the data-parallel axes, zero 2 gradients too, "
                           "zero 3 parameters too")
                zero = 0
            axes = self.check_axes(stmt.zero.axes, "zero") if stmt.zero.axes else (batch_axes or replica_axes)
            if axes is not None:
                zero_axes = axes
                if not replica_axes and zero:
                    self.error(E0407, "ZeRO shards over the data-parallel axes, but this plan has none",
                               stmt.zero.span, label=f"zero {zero}",
                               help="add `layout { batch -> data }` so the batch (and the optimizer states) split over an axis")
                elif not set(axes) <= set(replica_axes) and zero:
                    # A strict subset is HSDP: sharded within, replicated across the other batch axes.
                    what = "batch and context axes" if context_axes else "batch axes"
                    self.error(E0407, f"ZeRO must shard over the {what} ({' x '.join(replica_axes)}), not {' x '.join(axes)}",
                               stmt.zero.span, label="not the data-parallel axes",
                               help=f"write `zero {zero} over {' * '.join(replica_axes)}`: only ranks holding the same parameters can share their optimizer states",
                               suggestions=replace(stmt.zero.span, f"zero {zero} over {' * '.join(replica_axes)}",
                                                   f"Write `zero {zero} over {' * '.join(replica_axes)}`",
                                                   Applicability.MACHINE_APPLICABLE))
        return stmt.name.value, tuple(settings), zero, zero_axes

    def precision(self, dtype: str, zero: int, dtype_given: bool) -> tuple[str, str | None, str | None]:
        """The `precision { params, master, reduce }` statement: (compute dtype, master dtype,
        gradient-reduction dtype); None where the plan keeps one dtype for everything."""
        stmt = self.single(ast.PrecisionStmt, "`precision`")
        if stmt is None:
            return dtype, None, None
        seen: dict[str, ast.Setting] = {}
        values: dict[str, str] = {}
        for s in stmt.settings:
            key = s.name.value
            if key in MATMUL_KEYS:
                continue  # the float8 settings: checker/matmul.py
            if key not in PRECISION_KEYS:
                self.error(E0203, f"unknown precision setting `{key}`", s.name.span, label="not a precision setting",
                           **typo(s.name.span, key, (*PRECISION_KEYS, *MATMUL_KEYS)))
                continue
            if key in seen:
                self.repeated(f"precision setting `{key}`", s.name.span, seen[key].name.span)
                continue
            seen[key] = s
            if isinstance(s.value, ast.Name) and s.value.value in DTYPES:
                values[key] = s.value.value
            else:
                self.error(E0203, "unknown dtype", s.value.span, label="not a dtype", help=f"use one of {or_list(DTYPES)}")
        if "params" in values and dtype_given and values["params"] != dtype:
            self.error(E0203, f"`params = {values['params']}` contradicts the plan's `dtype = {dtype}`",
                       seen["params"].value.span, label="computes in another dtype",
                       help="give the compute dtype once: drop the plan's `dtype` or make them equal")
        compute = values.get("params", dtype)
        master = values.get("master", compute)
        reduce = values.get("reduce", compute if zero in (2, 3) else master)
        if DTYPES[master] < DTYPES[compute] and "master" in seen:
            self.error(E0203, f"master weights in {master} are narrower than the compute dtype {compute}",
                       seen["master"].value.span, label="would round every update more than the forward",
                       help=f"keep master weights at least as wide: `master = fp32` (or `params = {master}`)")
        if zero == 0 and reduce != master:
            # ZeRO 0 keeps the master weights as the parameters (runtime/train/amp.py: autocast), so
            # their gradients, and the all-reduce of them, are in the master dtype.
            self.error(E0309, f"`reduce = {reduce}` with ZeRO {zero}: gradients are reduced in the master dtype {master}",
                       seen["reduce"].value.span if "reduce" in seen else stmt.span,
                       label="only FSDP2 (zero 1 / 2 / 3 with master weights) reduces in another dtype",
                       help=f"write `reduce = {master}` (or leave it out), or shard with `zero 1`, `zero 2` or `zero 3`")
        return compute, master, reduce
