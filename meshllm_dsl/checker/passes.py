"""The plan checker as an ordered tuple of passes (as sqlglot's optimizer `RULES`).

Each pass is a function from a frozen `PassContext` (the plan declaration, its mesh and model, and the
results of the passes before it) to a `PassResult` (the values it derives and the diagnostics it
found). A pass sets no flag anywhere: what a later pass needs from it is a value of its result, and
`run_passes` threads the results in the order of `PASSES`, so the diagnostics come out in that
order. The rules themselves are the methods of the checker modules (placements.py, stages.py, ...);
a pass runs them on a worker of its own, seeded from the context, and keeps nothing of it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.checker.batch import BatchRules
from meshllm_dsl.checker.matmul import MatmulRules
from meshllm_dsl.checker.memory import MemoryRules
from meshllm_dsl.checker.optimizer import OptimizerRules
from meshllm_dsl.checker.packing import PackingRules
from meshllm_dsl.checker.pitfalls import PitfallRules
from meshllm_dsl.checker.placements import PlacementRules
from meshllm_dsl.checker.stages import StageRules
from meshllm_dsl.codes import E0203, E0307, E0309, E0412
from meshllm_dsl.diagnostics import Diagnostic, typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.names import or_list
from meshllm_dsl.front.resolve import Binding
from meshllm_dsl.ir import DTYPES, MeshIR, ModelIR, Repeat, Unit
from meshllm_dsl.parallel.devices import DeviceProfile

PLAN_SETTINGS = ("batch", "seq", "microbatches", "dtype", "recompute", "skew", "compile", "pack", "positions",
                 "context_balance")
# Settings the language used to accept that nothing downstream reads: refused until they are honoured.
UNSUPPORTEDPLAN_SETTINGS = {
    "seed": "the seed is chosen at launch: `meshc run FILE --seed N` (or `--seed N` on the generated module)",
    "lr": "set the learning rate on the optimizer: `optimizer adamw { lr = 0.001 }`",
}


def _frozen(values: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(values))


@attrs.frozen
class PassResult:
    """What one pass derived (read-only) and the diagnostics it found, in the order found."""

    values: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen)
    diagnostics: tuple[Diagnostic, ...] = ()

    @property
    def failed(self) -> bool:
        return any(d.is_error for d in self.diagnostics)


@attrs.frozen
class PassContext:
    """What a pass may read: the plan, its mesh and model, and every earlier pass's result."""

    decl: ast.PlanDecl
    mesh: MeshIR
    model: ModelIR
    per_host: int | None = None  # devices in one host of the mesh's device profile (None: unknown)
    profile: DeviceProfile | None = None  # the mesh's device profile (None: unknown)
    results: tuple[tuple[str, PassResult], ...] = ()

    def __getitem__(self, key: str) -> Any:
        """The value `key` as the latest pass that derived it left it."""
        for _name, r in reversed(self.results):
            if key in r.values:
                return r.values[key]
        raise KeyError(f"no pass before this one derives `{key}`")

    @property
    def failed(self) -> bool:
        """Some earlier pass reported an error for this plan."""
        return any(r.failed for _, r in self.results)

    def then(self, name: str, result: PassResult) -> PassContext:
        return attrs.evolve(self, results=(*self.results, (name, result)))


class _Worker(PlacementRules, StageRules, BatchRules, OptimizerRules, MatmulRules, PackingRules, MemoryRules,
              PitfallRules):
    """The rule methods over one pass's own state: made for a pass call and dropped after it."""

    @classmethod
    def of(cls, ctx: PassContext) -> _Worker:
        w = cls(ctx.decl, ctx.mesh, ctx.model, [], ctx.per_host)
        w.failed = ctx.failed
        if ctx.results:
            w.bad_settings = set(ctx["bad_settings"])
        return w

    def result(self, **values: Any) -> PassResult:
        return PassResult(values, tuple(self.diagnostics))


# -- the passes, in order


def settings(ctx: PassContext) -> PassResult:
    """The plan's `key = value` settings: known, given once, integers where they must be; dtype."""
    w = _Worker.of(ctx)
    given: dict[str, ast.Setting] = {}
    for stmt in ctx.decl.body:
        if not isinstance(stmt, ast.Setting):
            continue
        if stmt.name.value in given:
            w.repeated(f"plan setting `{stmt.name.value}`", stmt.name.span, given[stmt.name.value].name.span)
            continue
        given[stmt.name.value] = stmt
    env: dict[str, Binding] = {}  # plan settings are literals or arithmetic on literals
    values: dict[str, int] = {}
    for key, s in given.items():
        if key in UNSUPPORTEDPLAN_SETTINGS:
            w.error(E0309, f"plan setting `{key}` is not supported yet", s.name.span,
                    label="would be ignored", help=UNSUPPORTEDPLAN_SETTINGS[key])
            continue
        if key not in PLAN_SETTINGS:
            w.error(E0203, f"unknown plan setting `{key}`", s.name.span, label="not a plan setting",
                    **typo(s.name.span, key, PLAN_SETTINGS))
            continue
        if s.every is not None and key != "recompute":
            w.error(E0203, f"`every` does not apply to `{key}`", s.every.span, label="not a per-block setting",
                    help="`every N` picks the blocks `recompute` applies to: drop it here")
        if key in ("dtype", "recompute", "skew", "compile", "pack", "positions", "context_balance"):  # read by their own passes
            continue
        v = w.eval_int(s.value, env, key)
        if v is not None:
            values[key] = v
        else:
            w.bad_settings.add(key)
    dtype = ctx.model.dtype
    if "dtype" in given:
        v = given["dtype"].value
        if isinstance(v, ast.Name) and v.value in DTYPES:
            dtype = v.value
        else:
            w.error(E0203, "unknown dtype", v.span, label="not a dtype", help=f"use one of {or_list(DTYPES)}")
    return w.result(settings=given, setting_values=values, bad_settings=frozenset(w.bad_settings), dtype=dtype)


def recompute(ctx: PassContext) -> PassResult:
    w = _Worker.of(ctx)
    region, every = w.recompute(ctx["settings"].get("recompute"))
    return w.result(recompute=region, recompute_every=every)


def placements(ctx: PassContext) -> PassResult:
    """Layout entries and shard rules -> one placement per parameter, block classes and their flows.
    One pass: a misspelt rule's E0502 gets a note when coverage is computed (its `folded` leaves)."""
    w = _Worker.of(ctx)
    batch_axes, layout_matches = w.layout()
    matches = w.shard_rules(layout_matches)
    top, classes = w.placements(matches)
    return w.result(batch_axes=batch_axes, seq_axes=w.seq_axes, seq_entry=w.seq_entry, context_axes=w.context_axes,
                    expert_axes=w.expert_axes, expert_entry=w.expert_entry, top=top, classes=classes)


def loss(ctx: PassContext) -> PassResult:
    w = _Worker.of(ctx)
    return w.result(loss=w.loss(ctx["top"]))


def _seq(ctx: PassContext) -> int:
    """The plan's `seq`: as given, else 128, or the positions a model with learned positions has when it has fewer."""
    limits = [n for i in ctx.model.items if isinstance(i, Unit) and (n := primitives.of(i).position_limit(i)) is not None]
    return int(ctx["setting_values"].get("seq", min([128, *limits])))


def stages(ctx: PassContext) -> PassResult:
    w = _Worker.of(ctx)
    stage_map, pipeline_axis, virtual = w.stages(ctx["top"], ctx["classes"], _seq(ctx))
    return w.result(stages=stage_map, pipeline_axis=pipeline_axis, virtual=virtual)


def moe_routing(ctx: PassContext) -> PassResult:
    """A moe model's routing in this plan. (Router losses need no check: with pipeline stages the
    runtime sends each stage's routing statistics on with its activations, in fp32 under any
    `precision`: runtime/train/program.py.) `skew = F` (the planner's routing
    skew, meshllm_dsl/planner/moe.py): the share of a layer's routed (token, choice) pairs its
    busiest expert gets, 1 / experts (balanced) <= F <= 1 / top_k (a token's choices are distinct
    experts). Group-limited routing (`groups`, `topk_groups`) narrows the
    experts a token reaches, not the tokens one expert can take (every token may keep the busiest
    expert's group), so the same range and the planner's per-rank model apply to it unchanged."""
    w = _Worker.of(ctx)
    units = [u for item in ctx.model.items for u in (item.body if isinstance(item, Repeat) else (item,))]
    moes = [u for u in units if primitives.of(u).routes_experts]
    given = ctx["settings"].get("skew")
    skew = None
    if given is not None:
        if not moes:
            w.error(E0203, f"`skew` applies to a model with moe layers; `{ctx.model.name}` has none", given.name.span,
                    label="no experts to skew", help="remove `skew`")
        else:
            experts = min(int(u.attr("experts")) for u in moes)  # type: ignore[arg-type]
            skew = w.eval_float(given.value, {}, "`skew`", 0.0, 1.0)
            if skew is not None and skew < 1 / experts:
                w.error(E0307, f"`skew` = {skew:g} is less than 1 / experts = {1 / experts:.4g}", given.value.span,
                        label="the busiest expert gets at least an even share",
                        help=f"use 1 / {experts} <= skew <= 1: the share of a layer's routed tokens its busiest expert "
                        f"receives ({1 / experts:.4g} is balanced routing, 1 sends every token to one expert)")
                skew = None
            top_k = max(int(u.attr("top_k")) for u in moes)  # type: ignore[arg-type]
            if skew is not None and skew > 1 / top_k:
                # A token's top_k choices are distinct experts: one expert takes at most one of them.
                w.error(E0307, f"`skew` = {skew:g} is more than 1 / top_k = {1 / top_k:.4g}", given.value.span,
                        label=f"each token sends one of its {top_k} choices at most to one expert",
                        help=f"use 1 / {experts} <= skew <= 1 / {top_k}: a token's top {top_k} experts are distinct, "
                        f"so the busiest expert receives at most 1 / {top_k} of a layer's routed (token, choice) pairs")
                skew = None
    return w.result(skew=skew)


def schedule(ctx: PassContext) -> PassResult:
    w = _Worker.of(ctx)
    chosen = w.schedule(ctx["pipeline_axis"], ctx["virtual"])
    return w.result(schedule=chosen, bad_settings=frozenset(w.bad_settings))


def batch(ctx: PassContext) -> PassResult:
    """Batch, microbatches and seq with their defaults; learned positions; the batch split."""
    w = _Worker.of(ctx)
    values, given, batch_axes = ctx["setting_values"], ctx["settings"], ctx["batch_axes"]
    microbatches = values.get("microbatches", 1)
    size = values.get("batch", max(1, microbatches) * (ctx.mesh.size(*batch_axes) if batch_axes else 1))
    seq = _seq(ctx)
    if "seq" not in w.bad_settings:
        w.positions(seq, given.get("seq"))
    w.batch_checks(size, microbatches, batch_axes, given, ctx["stages"], ctx["schedule"])
    return w.result(batch=size, microbatches=microbatches, seq=seq)


def sequence_parallel(ctx: PassContext) -> PassResult:
    w = _Worker.of(ctx)
    w.seq_axes, w.seq_entry, w.context_axes = ctx["seq_axes"], ctx["seq_entry"], ctx["context_axes"]
    w.sequence_parallel(ctx["seq"], ctx["settings"].get("seq"))
    return w.result()


def context_parallel(ctx: PassContext) -> PassResult:
    w = _Worker.of(ctx)
    w.seq_entry, w.context_axes, w.seq_axes = ctx["seq_entry"], ctx["context_axes"], ctx["seq_axes"]
    w.context_parallel(ctx["seq"], ctx["settings"].get("seq"), ctx["pipeline_axis"], ctx["batch_axes"])
    return w.result()


def optimizer(ctx: PassContext) -> PassResult:
    w = _Worker.of(ctx)
    name, opt_settings, zero, zero_axes = w.optimizer(ctx["batch_axes"], ctx["context_axes"])
    return w.result(optimizer=name, optimizer_settings=opt_settings, zero=zero, zero_axes=zero_axes)


def precision(ctx: PassContext) -> PassResult:
    w = _Worker.of(ctx)
    dtype, master, reduce = w.precision(ctx["dtype"], ctx["zero"], "dtype" in ctx["settings"])
    return w.result(dtype=dtype, master_dtype=master, reduce_dtype=reduce)


def matmul(ctx: PassContext) -> PassResult:
    """Low-precision matmuls (`precision { matmul, all_gather }`, `precision PATH matmul = R`) and
    `compile = blocks`: checker/matmul.py."""
    w = _Worker.of(ctx)
    float8 = w.matmul(ctx["dtype"], ctx["master_dtype"], ctx["zero"], ctx["top"], ctx["classes"], ctx.profile)
    compiled = w.compile_setting(ctx["settings"].get("compile"))
    w.eager_float8(float8, compiled, ctx.profile)
    return w.result(float8=float8, compile=compiled)


def packing(ctx: PassContext) -> PassResult:
    """`pack = documents`, `positions = restart` and `context_balance`: checker/packing.py."""
    w = _Worker.of(ctx)
    settings = dict(ctx["settings"])
    masked, restart = w.packing(settings)
    balance = w.context_balance(settings, masked, ctx["context_axes"])
    return w.result(document_mask=masked, restart_positions=restart, context_balance=balance)


def expert_zero(ctx: PassContext) -> PassResult:
    """ZeRO with expert parallelism (E0412): what the runtime shards the experts' states over; the
    tokens splitting over the experts' tensor axes."""
    w = _Worker.of(ctx)
    entry, zero, zero_axes, expert_axes = ctx["expert_entry"], ctx["zero"], ctx["zero_axes"], ctx["expert_axes"]
    # ZeRO 1 without `precision` (ZeroRedundancyOptimizer) shards the experts' states over the ZeRO
    # ranks that hold the same experts, whatever the axes. FSDP2 (ZeRO 2 / 3, and ZeRO 1 with master
    # weights) shards each layer's experts over the ZeRO axes that replicate them (runtime/parallel/fsdp.py),
    # reducing their gradients there only: right where no other batch or context axis replicates them.
    fsdp = zero >= 2 or (zero == 1 and ctx["master_dtype"] is not None)
    rest = [a for a in zero_axes if a not in expert_axes]
    others = [a for a in (*ctx["batch_axes"], *ctx["context_axes"]) if a not in expert_axes and a not in zero_axes]
    if entry is not None and fsdp and rest and others:
        what = f"ZeRO {zero}" + (" with `precision`" if zero == 1 else "")
        every = [a for a in (*ctx["batch_axes"], *ctx["context_axes"]) if a in {*expert_axes, *rest, *others}]
        alternatives = [f"`zero {zero} over {' * '.join(every)}` (the experts sharded over "
                        "every axis that replicates them)", f"`zero {zero} over {' * '.join(expert_axes)}` (HSDP: "
                        "sharded over the expert axes, replicated over the rest)",
                        "`zero 1` without `precision` (it shards the experts' optimizer states over the ranks "
                        "that hold the same experts)"]
        w.error(E0412, f"{what} over {' x '.join(rest)}, which replicates the experts, while {' x '.join(others)} "
                "replicates them too, is not supported yet",
                entry.span, label=f"the experts split over {' x '.join(expert_axes)} only",
                help="FSDP2 would have to shard the experts over some of the ranks that replicate them and "
                f"all-reduce them over the others; use {or_list(alternatives)}")
    # Experts over tensor axes: each of their ranks routes an equal share of a microbatch's tokens
    # on this rank (runtime/moe/dispatch.py ExpertsParallel.experts).
    split = [a for a in expert_axes if a not in ctx["batch_axes"] and a not in ctx["context_axes"]]
    if entry is not None and split and not {"batch", "seq", "microbatches"} & ctx["bad_settings"]:
        batch_axes, context_axes = ctx["batch_axes"], ctx["context_axes"]
        per = ctx["batch"] // (ctx.mesh.size(*batch_axes) if batch_axes else 1) // max(1, ctx["microbatches"])
        tokens = per * ctx["seq"] // (ctx.mesh.size(*context_axes) if context_axes else 1)
        n = ctx.mesh.size(*split)
        if tokens % n:
            w.error(E0412, f"{tokens} tokens per microbatch on a rank do not split over {' x '.join(split)} ({n})",
                    entry.span if isinstance(entry, ast.LayoutEntry) else entry.rule.span,
                    label=f"each rank of {' x '.join(split)} routes 1 / {n} of the tokens",
                    help=f"make batch / (batch ranks x microbatches) x seq / (context ranks) a multiple of {n}, "
                    "or split the experts over batch and context axes only")
    return w.result()


def axis_roles(ctx: PassContext) -> PassResult:
    """One role per mesh axis (E0407), tensor axes within a host (W0702), no axis unused (W0704)."""
    w = _Worker.of(ctx)
    w.axis_usage(ctx["top"], ctx["classes"], ctx["pipeline_axis"], ctx["batch_axes"], ctx["context_axes"])
    return w.result()


def pitfalls(ctx: PassContext) -> PassResult:
    """The sharding pitfalls of a plan that checked clean (W0705-W0707)."""
    w = _Worker.of(ctx)
    w.sharding_warnings(ctx["top"], ctx["classes"])
    return w.result()


Pass = Callable[[PassContext], PassResult]

PASSES: tuple[Pass, ...] = (
    settings,
    recompute,
    placements,
    loss,
    stages,
    moe_routing,
    schedule,
    batch,
    sequence_parallel,
    context_parallel,
    optimizer,
    precision,
    matmul,
    packing,
    expert_zero,
    axis_roles,
    pitfalls,
)


# Passes that judge what only a plan without errors has (its placements may be guesses otherwise):
# after an error the driver gives them an empty result instead of running them.
CLEAN_ONLY: frozenset[Pass] = frozenset({pitfalls})


def run_passes(ctx: PassContext, passes: tuple[Pass, ...] = PASSES) -> PassContext:
    """Every pass in order, each seeing the results before it; the context with all their results."""
    for p in passes:
        ctx = ctx.then(p.__name__, PassResult() if p in CLEAN_ONLY and ctx.failed else p(ctx))
    return ctx
