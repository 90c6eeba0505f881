"""The checker: declarations -> checked plans (PlanIR) plus every diagnostic, all at once.

Stages of a plan check, in order: names and values (resolve.py), rules -> placements with coverage,
divisibility of every sharded dim, activation layouts through each block (layouts.py), the pipeline
stage map, batch / schedule / optimizer constraints, and the pitfall warnings.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from meshllm_dsl import ast
from meshllm_dsl.devices import DEFAULT_PROFILE, PROFILES, declared_profiles
from meshllm_dsl.diagnostics import Diagnostic, Label
from meshllm_dsl.ir import (
    REPLICATE,
    RULES,
    SCHEDULES,
    BlockClass,
    Leaf,
    MeshIR,
    ModelIR,
    Placement,
    PlanIR,
    Repeat,
    Stage,
    StagePiece,
    Unit,
)
from meshllm_dsl.layouts import block_flows, top_flows
from meshllm_dsl.load import Declarations, load
from meshllm_dsl.names import did_you_mean, divisors, or_list, ranges
from meshllm_dsl.parser import paused_gc
from meshllm_dsl.resolve import Binding, ModelResolver, Resolver, resolve_mesh
from meshllm_dsl.source import Span


@attrs.frozen
class CheckResult:
    """What `meshc check` and the API return: diagnostics and everything that checked clean."""

    diagnostics: tuple[Diagnostic, ...]
    plans: dict[str, PlanIR]
    meshes: dict[str, MeshIR]
    models: dict[str, ModelIR]
    sources: tuple[str, ...] = ()
    text: str = ""  # the root spec as checked (normalized): what generated code is made from and hashes

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.is_error]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if not d.is_error]


def check_file(path: str | Path) -> CheckResult:
    return check_declarations(load(path))


def check_text(text: str, path: str = "<string>") -> CheckResult:
    return check_declarations(load(path, text))


def check_declarations(decls: Declarations) -> CheckResult:
    with paused_gc():
        return _check_declarations(decls)


def _check_declarations(decls: Declarations) -> CheckResult:
    diags: list[Diagnostic] = list(decls.diagnostics)
    r = Resolver(diags)

    def named(kind: type, what: str) -> dict[str, ast.Item]:
        out: dict[str, ast.Item] = {}
        for item in decls.user(kind):
            name = item.name  # type: ignore[attr-defined]
            if name.value in out:
                first = out[name.value].name  # type: ignore[attr-defined]
                r.error("E0201", f"{what} `{name.value}` is declared twice", name.span, label="second declaration",
                        secondary=(Label(first.span, "first declared here"),), help=f"rename one of the {_plural(what)}")
                continue
            out[name.value] = item
        return out

    devices = named(ast.DeviceDecl, "device")
    profiles, device_diags = declared_profiles(devices.values())  # type: ignore[arg-type]
    diags.extend(device_diags)
    mesh_decls = named(ast.MeshDecl, "mesh")
    families: dict[str, ast.FamilyDecl] = {f.name.value: f for f in decls.prelude if isinstance(f, ast.FamilyDecl)}
    user_families = named(ast.FamilyDecl, "family")
    for fam in user_families.values():
        r.check_identifier(fam.name, "family")  # type: ignore[attr-defined]
        firsts: dict[str, ast.Param] = {}
        for param in fam.params:  # type: ignore[attr-defined]
            if param.name.value in firsts:
                r.repeated(f"family parameter `{param.name.value}`", param.name.span, firsts[param.name.value].name.span)
            firsts.setdefault(param.name.value, param)
    families.update(user_families)  # type: ignore[arg-type]
    model_decls = named(ast.ModelDecl, "model")
    plan_decls = named(ast.PlanDecl, "plan")

    meshes: dict[str, MeshIR] = {}
    for name, decl in mesh_decls.items():
        mesh = resolve_mesh(decl, r, list(devices))  # type: ignore[arg-type]
        if mesh is not None:
            meshes[name] = mesh
    models: dict[str, ModelIR] = {}
    mr = ModelResolver(diags, families)
    for name, decl in model_decls.items():
        model = mr.resolve(decl)  # type: ignore[arg-type]
        if model is not None:
            models[name] = model

    plans: dict[str, PlanIR] = {}
    for name, decl in plan_decls.items():
        assert isinstance(decl, ast.PlanDecl)
        name_ok = r.check_identifier(decl.name, "plan")
        mesh = meshes.get(decl.mesh.value)
        model = models.get(decl.model.value)
        if decl.mesh.value not in mesh_decls:
            r.error("E0202", f"unknown mesh `{decl.mesh.value}`", decl.mesh.span, label="no such mesh",
                    help=did_you_mean(decl.mesh.value, mesh_decls))
        if decl.model.value not in model_decls:
            r.error("E0202", f"unknown model `{decl.model.value}`", decl.model.span, label="no such model",
                    help=did_you_mean(decl.model.value, model_decls))
        if mesh is None or model is None:
            continue
        profile = {**PROFILES, **profiles}.get(mesh.device or DEFAULT_PROFILE)
        per_host = profile.per_host if profile is not None else None
        plan = PlanChecker(decl, mesh, model, diags, per_host).check()
        if plan is not None and name_ok:
            plans[name] = plan
    return CheckResult(tuple(diags), plans, meshes, models, tuple(s.path for s in decls.sources),
                       decls.root.text if decls.root is not None else "")


# ---------------------------------------------------------------- plan checking

_PLAN_SETTINGS = ("batch", "seq", "microbatches", "dtype", "recompute")
# Settings the language used to accept that nothing downstream reads: refused until they are honoured.
_UNSUPPORTED_PLAN_SETTINGS = {
    "seed": "the seed is chosen at launch: `meshc run FILE --seed N` (or `--seed N` on the generated module)",
    "lr": "set the learning rate on the optimizer: `optimizer adamw { lr = 0.001 }`",
}
# Optimizer settings and their ranges (low, high, low_open, high_open), as torch.optim.AdamW takes them.
_OPT_SETTINGS = {
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
_OPT_STEP_COUNTS = ("warmup", "decay_steps")


@attrs.define
class _Match:
    """A placement source (a shard rule or a layout entry) and the blocks it covers for one leaf."""

    placement: Placement
    span: Span | None
    blocks: frozenset[int] | None  # None: every block (or a top-level leaf)
    text: str


class PlanChecker(Resolver):
    def __init__(self, decl: ast.PlanDecl, mesh: MeshIR, model: ModelIR, diags: list[Diagnostic],
                 per_host: int | None = None) -> None:
        super().__init__(diags)
        self.per_host = per_host  # devices in one host of the mesh's device profile (None: unknown)
        self.decl = decl
        self.mesh = mesh
        self.model = model
        self.failed = False
        self.repeat = model.repeat
        self.reported: set[tuple[int, str]] = set()  # divisibility errors already given, per rule
        self.by_leaf: dict[Leaf, list[_Match]] = {}  # every rule's matches (set by placements)
        self.claimed: set[Leaf] = set()  # leaves matched by a rule that was rejected
        self.ambiguous = False  # some leaf is matched by two rules (E0503): its layout is unknown

    def error(self, code: str, message: str, span: Span | None, **kw: object) -> None:
        if not code.startswith("W"):
            self.failed = True
        super().error(code, message, span, **kw)

    def error_count(self) -> int:
        return sum(d.is_error for d in self.diagnostics)

    def warn(self, code: str, message: str, span: Span | None, **kw: object) -> None:
        super().error(code, message, span, **kw)

    def axis_label(self, name: str) -> tuple[Label, ...]:
        axis = self.mesh.axis(name)
        if axis is None or axis.span is None:
            return ()
        return (Label(axis.span, f"`{name}` = {axis.size} declared here"),)

    def check_axes(self, names: Sequence[ast.Name], what: str) -> tuple[str, ...] | None:
        """Validate a list of axis names: each declared on the mesh, none twice.

        The result is in mesh order, whatever order the spec lists them in: a tensor split over
        several axes is chunked by the flattened mesh coordinate, and torch orders a group's
        members by global rank, so only mesh order makes chunk index and group rank agree.
        """
        out: list[str] = []
        ok = True
        for n in names:
            if self.mesh.axis(n.value) is None:
                self.error("E0202", f"unknown mesh axis `{n.value}`", n.span, label=f"not an axis of `{self.mesh.name}`",
                           help=did_you_mean(n.value, [a.name for a in self.mesh.axes]))
                ok = False
            elif n.value in out:
                self.error("E0401", f"mesh axis `{n.value}` is used twice in {what}", n.span, label="used again",
                           help="a tensor dim can be split over an axis once; list each axis once")
                ok = False
            else:
                out.append(n.value)
        order = [a.name for a in self.mesh.axes]
        return tuple(sorted(out, key=order.index)) if ok else None

    def single(self, kind: type, what: str):  # type: ignore[no-untyped-def]
        """The plan's one statement of `kind` (or None); a repeat of it is an error pointing at both."""
        stmts = [s for s in self.decl.body if isinstance(s, kind)]
        for extra in stmts[1:]:
            self.repeated(what, extra.span, stmts[0].span)
        return stmts[0] if stmts else None

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
        self.bad_settings: set[str] = set()  # given but rejected: checks that read them stay quiet
        for key, s in settings.items():
            if key in _UNSUPPORTED_PLAN_SETTINGS:
                self.error("E0309", f"plan setting `{key}` is not supported yet", s.name.span,
                           label="would be ignored", help=_UNSUPPORTED_PLAN_SETTINGS[key])
                continue
            if key not in _PLAN_SETTINGS:
                self.error("E0203", f"unknown plan setting `{key}`", s.name.span, label="not a plan setting",
                           help=did_you_mean(key, _PLAN_SETTINGS))
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
                self.error("E0203", "unknown dtype", v.span, label="not a dtype", help=f"use one of {or_list(DTYPES)}")

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
        optimizer, opt_settings, zero, zero_axes = self.optimizer(batch_axes)
        self.axis_usage(top, classes, pipeline_axis, batch_axes)
        if not self.failed:
            self.sharding_warnings(top, classes)
        if self.failed:
            return None
        return PlanIR(
            name=decl.name.value, mesh=self.mesh, model=self.model, batch=batch, seq=seq,
            microbatches=microbatches, schedule=schedule, virtual=virtual, pipeline_axis=pipeline_axis,
            batch_axes=batch_axes, stages=stages, top_placements=tuple(top.items()),
            top_flows=tuple(top_flows(self.model, top, loss)), block_classes=classes, loss=loss,
            optimizer=optimizer, optimizer_settings=opt_settings, zero=zero, zero_axes=zero_axes,
            dtype=dtype, recompute=recompute, span=decl.span,
        )

    def recompute(self, given: ast.Setting | None) -> str:
        """`recompute = none | blocks | attention`: which activations backward recomputes."""
        from meshllm_dsl.ir import RECOMPUTE

        if given is None:
            return "none"
        v = given.value
        if not (isinstance(v, ast.Name) and v.value in RECOMPUTE):
            self.error("E0203", "unknown recompute region", v.span, label="not a region",
                       help=f"use one of {or_list(RECOMPUTE)}: `blocks` recomputes each block of the repeat in "
                            "backward, `attention` only the attention core")
            return "none"
        region = v.value
        rep = self.model.repeat
        if region == "blocks" and rep is None:
            self.error("E0409", "`recompute = blocks` needs a repeated block stack", v.span,
                       label="no blocks to recompute", help=f"model `{self.model.name}` has no `repeat`: remove the setting")
        elif region == "attention" and (rep is None or not any(u.kind == "attention" for u in rep.body)):
            self.error("E0409", "`recompute = attention` needs attention inside the repeated blocks", v.span,
                       label="no attention to recompute",
                       help=f"model `{self.model.name}` has no attention in a `repeat`: use `recompute = blocks` or remove the setting")
        return region

    def positions(self, seq: int, given: ast.Setting | None) -> None:
        """Learned positions have a table of `num` rows: a longer sequence would index past it."""
        for item in self.model.items:
            if isinstance(item, Unit) and item.kind == "positional" and seq > int(item.attr("num")):  # type: ignore[arg-type]
                num = item.attr("num")
                self.error("E0310", f"seq {seq} is longer than the {num} positions of `{item.name}`",
                           given.value.span if given is not None else self.decl.name.span,
                           label=f"seq = {seq}" if given is not None else f"`seq` is not set (so {seq})",
                           secondary=(Label(item.span, f"{num} learned positions"),) if item.span else (),
                           help=f"{'use' if given is not None else 'set'} `seq = {num}` or less, or give the model more positions")

    # -- layout entries: logical dim -> mesh axes
    def layout(self) -> tuple[tuple[str, ...], list[tuple[Leaf, _Match]]]:
        batch_axes: tuple[str, ...] = ()
        out: list[tuple[Leaf, _Match]] = []
        dims_seen: dict[str, ast.LayoutEntry] = {}
        for stmt in self.decl.body:
            if not isinstance(stmt, ast.LayoutStmt):
                continue
            for e in stmt.entries:
                dim = e.dim.value
                if dim in dims_seen:
                    self.error("E0201", f"`{dim}` is laid out twice", e.dim.span, label="second entry",
                               secondary=(Label(dims_seen[dim].span, "first here"),), help="map each dim once")  # type: ignore[arg-type]
                    continue
                dims_seen[dim] = e
                axes = self.check_axes(e.axes, f"the layout of `{dim}`")
                if axes is None:
                    # The entry is wrong (reported); what it names is not also "placed by no rule" (E0501).
                    self.claimed.update(leaf for _, _, leaf in self.model.leaves() if leaf.shardable and any(
                        u[0] == dim for u in (*leaf.out_units[:1], *leaf.in_units)))
                    continue
                if dim == "batch":
                    batch_axes = axes
                    continue
                hits = self.layout_leaves(dim, axes, e)
                if not hits:
                    known = sorted({u[0] for _, _, leaf in self.model.leaves() if leaf.shardable for u in leaf.in_units + leaf.out_units} | {"batch"})
                    self.error("E0502", f"layout entry `{dim}` matches no parameter", e.dim.span,
                               label="no layer has this dim", help=did_you_mean(dim, known))
                out.extend(hits)
        return batch_axes, out

    def layout_leaves(self, dim: str, axes: tuple[str, ...], e: ast.LayoutEntry) -> list[tuple[Leaf, _Match]]:
        hits = []
        for _, _, leaf in self.model.leaves():
            if not leaf.shardable:
                continue
            out_hit = any(u[0] == dim for u in leaf.out_units[:1])
            in_hit = any(u[0] == dim for u in leaf.in_units)
            if not (out_hit or in_hit):
                continue
            if out_hit and in_hit:
                self.error("E0401", f"`{dim} -> {' * '.join(axes)}` would split both dims of `{'.'.join(leaf.path)}`",
                           e.span, label="both input and output are this dim",
                           help="shard this layer with an explicit `shard` rule instead")
                self.claimed.add(leaf)
                continue
            if out_hit:
                rule = "vocab_parallel" if leaf.kind == "embedding" else "column"
            else:
                rule = "row"
            text = f"layout {dim} -> {' * '.join(axes)}"
            hits.append((leaf, _Match(Placement(rule, axes, e.span), e.span, None, text)))
        return hits

    # -- shard rules
    def shard_rules(self, matches: list[tuple[Leaf, _Match]]) -> dict[Leaf, list[_Match]]:
        by_leaf: dict[Leaf, list[_Match]] = {}
        for leaf, m in matches:
            by_leaf.setdefault(leaf, []).append(m)
        for stmt in self.decl.body:
            if not isinstance(stmt, ast.ShardStmt):
                continue
            placement = self.rule(stmt.rule)
            hits = self.match_path(stmt.path)
            if not hits:
                continue
            for leaf, blocks in hits:
                if placement is None or not self.rule_fits(leaf, placement, stmt):
                    # The rule is wrong (reported); the leaf is not also "placed by no rule" (E0501).
                    self.claimed.add(leaf)
                    continue
                by_leaf.setdefault(leaf, []).append(_Match(placement, stmt.span, blocks, f"shard {stmt.path}"))
        return by_leaf

    def rule(self, rule: ast.Rule) -> Placement | None:
        name = rule.name.value
        if name not in RULES:
            self.error("E0406", f"unknown sharding rule `{name}`", rule.name.span, label="not a rule",
                       help=f"use {or_list(f'`{r}`' for r in RULES)}")
            return None
        if name == "replicate":
            if rule.axes:
                self.error("E0406", "`replicate` takes no axes", rule.span, label="remove the axes",
                           help="`replicate` keeps a full copy on every device")
                return None
            return Placement("replicate", (), rule.span)
        if not rule.axes:
            self.error("E0406", f"`{name}` needs the mesh axes to shard over", rule.span, label="no axes given",
                       help=f"e.g. `{name}({next((a.name for a in self.mesh.axes if a.name == 'tensor'), self.mesh.axes[-1].name)})`")
            return None
        axes = self.check_axes(rule.axes, f"`{name}`")
        if axes is None:
            return None
        return Placement(name, axes, rule.span)

    def rule_fits(self, leaf: Leaf, p: Placement, stmt: ast.ShardStmt) -> bool:
        path = ".".join(leaf.path)
        if p.rule == "replicate":
            return True
        if not leaf.shardable:
            self.error("E0405", f"`{path}` is a {leaf.kind}; it cannot be sharded with `{p.rule}`", stmt.rule.span,
                       label="not shardable", help=f"{leaf.kind} parameters are small and stay replicated: use `replicate` or remove the rule")
            return False
        if leaf.kind == "embedding" and p.rule != "vocab_parallel":
            self.error("E0405", f"embedding `{path}` can only be `vocab_parallel` or `replicate`", stmt.rule.span,
                       label=f"`{p.rule}` is not supported for embeddings",
                       help=f"use `vocab_parallel({', '.join(p.axes)})`: it splits the vocabulary rows")
            return False
        if leaf.kind == "linear" and p.rule == "vocab_parallel":
            self.error("E0405", f"`vocab_parallel` applies to embeddings; `{path}` is a linear layer", stmt.rule.span,
                       label="not an embedding",
                       help=f"use `column({', '.join(p.axes)})`: for an output projection it splits the vocabulary")
            return False
        return True

    def match_path(self, path: ast.Path) -> list[tuple[Leaf, frozenset[int] | None]]:
        """Leaves a pattern matches, with the blocks it covers for leaves inside the repeat."""
        segs = path.segments
        hits: list[tuple[Leaf, frozenset[int] | None]] = []
        for item, _unit, leaf in self.model.leaves():
            if isinstance(item, Repeat):
                if len(segs) != len(leaf.path) + 2 or not _seg_matches(segs[0], item.name):
                    continue
                idx = segs[1]
                if idx.kind == "star":
                    blocks = None
                elif idx.kind == "index":
                    if idx.index >= item.count:
                        continue
                    blocks = frozenset([idx.index])
                else:
                    continue
                if all(_seg_matches(s, n) for s, n in zip(segs[2:], leaf.path)):
                    hits.append((leaf, blocks))
            elif len(segs) == len(leaf.path) and all(_seg_matches(s, n) for s, n in zip(segs, leaf.path)):
                hits.append((leaf, None))
        if hits:
            # every alternative in `{a,b}` must name something, or the rule silently matches less
            for s in segs:
                if s.kind == "alt":
                    for n in s.names:
                        if not any(n in (leaf.path) or (isinstance(item, Repeat) and n == item.name)
                                   for item, _, leaf in self.model.leaves()):
                            self.error("E0502", f"`{n}` in `{path}` matches no layer", s.span, label=f"no layer `{n}`",
                                       help=did_you_mean(n, {p for _, _, lf in self.model.leaves() for p in lf.path}))
            return hits
        self.error("E0502", f"rule `{path}` matches no layer", path.span, label="matches nothing",
                   help=self.path_help(path))
        return []

    def path_help(self, path: ast.Path) -> str:
        segs = path.segments
        rep = self.repeat
        if rep is not None and segs and _seg_matches(segs[0], rep.name) and len(segs) > 1 and segs[1].kind == "index":
            if segs[1].index >= rep.count:
                return f"`{rep.name}` has {rep.count} blocks, numbered 0 to {rep.count - 1}"
        # A pattern naming a composite (attention, mlp): list its layers.
        text = str(path)
        for item, unit, _leaf in self.model.leaves():
            prefix = (f"{item.name}.*." if isinstance(item, Repeat) else "") + unit.name
            if text == prefix or text.endswith("." + unit.name) and len(unit.leaves) > 1:
                names = ",".join(lf.name for lf in unit.leaves)
                return f"`{unit.name}` is a {unit.kind}; its layers are {{{names}}}: e.g. `{prefix}.{{{names}}}`"
        paths = []
        for item, _, leaf in self.model.leaves():
            paths.append((f"{item.name}.*." if isinstance(item, Repeat) else "") + ".".join(leaf.path))
        return "layers are " + ", ".join(dict.fromkeys(paths))

    # -- placements per leaf, coverage, overlap, divisibility
    def placements(self, by_leaf: dict[Leaf, list[_Match]]) -> tuple[dict[str, Placement], tuple[BlockClass, ...]]:
        self.by_leaf = by_leaf  # help lines look across rules (units_over)
        any_rules = bool(by_leaf) or bool(self.claimed)
        top: dict[str, Placement] = {}
        per_leaf_default: dict[tuple[str, ...], Placement] = {}
        per_leaf_exceptions: dict[tuple[str, ...], dict[int, Placement]] = {}
        for item, _unit, leaf in self.model.leaves():
            ms = by_leaf.get(leaf, [])
            in_repeat = isinstance(item, Repeat)
            self.overlaps(leaf, ms, item)
            full = ".".join(leaf.path)
            if in_repeat:
                default = next((m.placement for m in ms if m.blocks is None), None)
                exceptions: dict[int, Placement] = {}
                for m in ms:
                    if m.blocks is not None:
                        for b in m.blocks:
                            exceptions.setdefault(b, m.placement)
                if default is None and any_rules and leaf.shardable and leaf not in self.claimed:
                    missing = [b for b in range(item.count) if b not in exceptions]
                    if missing:
                        pattern = f"{item.name}.{'*' if len(missing) == item.count else missing[0]}.{full}"
                        self.uncovered(leaf, _unit, f"{item.name}.{_blocks_text(missing)}.{full}", pattern, by_leaf)
                per_leaf_default[leaf.path] = default or REPLICATE
                per_leaf_exceptions[leaf.path] = exceptions
                placements = [default or REPLICATE, *exceptions.values()]
            else:
                if not ms and any_rules and leaf.shardable and leaf not in self.claimed:
                    self.uncovered(leaf, _unit, full, full, by_leaf)
                top[full] = ms[0].placement if ms else REPLICATE
                placements = [top[full]]
            for p in placements:
                self.divisibility(leaf, p)
        self.tied(top)
        classes = self.block_classes(per_leaf_default, per_leaf_exceptions)
        return top, classes

    def overlaps(self, leaf: Leaf, ms: list[_Match], item: object) -> None:
        # One sweep, linear in the blocks the rules name (a plan may have a rule per block): for each
        # rule, the earliest earlier rule that shares a block with it.
        whole: int | None = None  # index of the first rule for every block
        owner: dict[int, int] = {}  # block -> index of the first rule naming it
        for i, a in enumerate(ms):
            if a.blocks is None:
                j = 0 if i else None  # every earlier rule overlaps a rule for all blocks
                whole = i if whole is None else whole
            else:
                hits = [owner[blk] for blk in a.blocks if blk in owner]
                if whole is not None:
                    hits.append(whole)
                j = min(hits) if hits else None
                for blk in a.blocks:
                    owner.setdefault(blk, i)
            if j is None:
                continue
            b = ms[j]
            # A rule for all blocks and one for block 3 also overlap: letting the specific one
            # win silently would make the plan's meaning depend on which rule a reader notices.
            where = ".".join(leaf.path)
            if isinstance(item, Repeat):
                shared = a.blocks & b.blocks if a.blocks is not None and b.blocks is not None else (a.blocks or b.blocks)
                where = f"{item.name}.{'*' if shared is None else _blocks_text(sorted(shared))}.{where}"
            self.ambiguous = True
            self.error("E0503", f"`{where}` is matched by two rules", a.span, label=f"{a.text} also matches it",
                       secondary=(Label(b.span, f"first matched by {b.text}"),) if b.span else (),
                       help="make the patterns disjoint: every parameter must be placed by exactly one rule")
            return

    def uncovered(self, leaf: Leaf, unit: Unit, where: str, pattern: str, by_leaf: dict[Leaf, list[_Match]]) -> None:
        # Suggest the rule that fits the leaf's role: the last projection of attention / mlp is row,
        # the others column, an embedding vocab_parallel, over the axes the plan shards most over.
        counts: dict[tuple[str, ...], int] = {}
        for ms in by_leaf.values():
            for m in ms:
                if m.placement.sharded:
                    counts[m.placement.axes] = counts.get(m.placement.axes, 0) + 1
        if counts:
            axes = ", ".join(max(counts, key=lambda a: counts[a]))
            if leaf.kind == "embedding":
                rule = f"vocab_parallel({axes})"
            elif len(unit.leaves) > 1 and leaf is unit.leaves[-1]:
                rule = f"row({axes})"
            else:
                rule = f"column({axes})"
            fix = f"add `shard {pattern} {rule}` (or `replicate` to keep a full copy)"
        else:
            fix = f"add `shard {pattern} replicate`"
        self.error("E0501", f"`{where}` is not placed by any rule", self.decl.name.span,
                   label=f"plan `{self.decl.name.value}` leaves it out",
                   secondary=(Label(leaf.span, f"`{leaf.name}` declared here"),) if leaf.span else (),
                   help=f"{fix}; a plan with rules must place every parameter")

    def divisibility(self, leaf: Leaf, p: Placement) -> None:
        if not p.sharded:
            return
        n = self.mesh.size(*p.axes)
        units = leaf.in_units if p.rule == "row" else leaf.out_units
        axes_text = " x ".join(p.axes)
        for unit_name, count in units:
            if count % n == 0:
                continue
            key = (p.span.start if p.span else 0, axes_text)  # one error per rule, naming every dim it breaks
            if key in self.reported:
                continue
            self.reported.add(key)
            # The help names the dims this rule splits, and the sizes that divide every dim the plan
            # splits over these axes (so the suggestion does not just move the error elsewhere).
            all_units = self.units_over(p.axes)
            mine = {u: c for u, c, where in all_units if where == (p.span.start if p.span else None)}
            mine.setdefault(unit_name, count)
            others = {u: c for u, c, _ in all_units if u not in mine}
            common = math.gcd(*mine.values(), *others.values())
            listing = " and ".join(f"{c} {u}" for u, c in mine.items())
            mine_gcd = math.gcd(*mine.values())
            restrict = [f"{c} {u}" for u, c in others.items() if math.gcd(mine_gcd, c) != mine_gcd]
            also = f" (and {', '.join(restrict)}, split over it by other rules)" if restrict else ""
            failing = [(u, c) for u, c in mine.items() if c % n]
            names = " and ".join(f"`{u}` ({c})" for u, c in failing)
            self.error(
                "E0301",
                f"{names} {'is' if len(failing) == 1 else 'are'} not divisible by {axes_text} ({n})",
                p.span,
                label=f"splits {count} {unit_name} over {n} devices",
                secondary=tuple(lab for a in p.axes for lab in self.axis_label(a)),
                help=f"{axes_text} must divide {listing}{also}: use {or_list(divisors(common))}"
                + (f", or pad `{unit_name}` to {-(-count // n) * n} (a multiple of {n})" if unit_name == "vocab" else ""),
            )

    def units_over(self, axes: tuple[str, ...]) -> list[tuple[str, int, int | None]]:
        """Every (unit, count, rule start offset) this plan splits over exactly these axes, for a help line."""
        seen: dict[str, tuple[str, int, int | None]] = {}
        for leaf, matches in self.by_leaf.items():
            for m in matches:
                p = m.placement
                if not p.sharded or p.axes != axes:
                    continue
                for u, c in leaf.in_units if p.rule == "row" else leaf.out_units:
                    seen.setdefault(u, (u, c, p.span.start if p.span else None))
        return list(seen.values())

    def tied(self, top: dict[str, Placement]) -> None:
        for _, _, leaf in self.model.leaves():
            if leaf.tie is None:
                continue
            mine, theirs = top.get(".".join(leaf.path), REPLICATE), top.get(leaf.tie, REPLICATE)
            same = (mine.sharded, mine.axes) == (theirs.sharded, theirs.axes)
            if not same:
                self.error("E0408", f"`{leaf.name}` shares its weight with `{leaf.tie}` but is placed differently",
                           mine.span or leaf.span, label=f"{mine.rule}{'(' + ', '.join(mine.axes) + ')' if mine.axes else ''}",
                           secondary=(Label(theirs.span, f"`{leaf.tie}` is {theirs.rule}"),) if theirs.span else (),
                           help=(f"make `{leaf.name}` `column({', '.join(theirs.axes)})` to split the same vocabulary rows as `{leaf.tie}`, or replicate both"
                                 if theirs.sharded else
                                 f"make `{leaf.tie}` `vocab_parallel({', '.join(mine.axes)})` to split the same vocabulary rows as `{leaf.name}`, or replicate both"))

    def block_classes(self, default: dict[tuple[str, ...], Placement], exceptions: dict[tuple[str, ...], dict[int, Placement]]) -> tuple[BlockClass, ...]:
        rep = self.repeat
        if rep is None:
            return ()
        special = sorted({b for ex in exceptions.values() for b in ex})
        combos: dict[tuple[tuple[str, Placement], ...], list[int]] = {}
        base = tuple((".".join(p), pl) for p, pl in default.items())
        special_set = set(special)
        rest = [b for b in range(rep.count) if b not in special_set]
        if rest:
            combos.setdefault(base, []).extend(rest)
        for b in special:
            key = tuple((".".join(p), exceptions[p].get(b, pl)) for p, pl in default.items())
            combos.setdefault(key, []).append(b)
        classes = []
        for key, idx in sorted(combos.items(), key=lambda kv: min(kv[1])):
            # With two rules on one parameter its placement is unknown: layout errors would be guesses.
            reporter = _Silent() if self.ambiguous else self
            # Diagnostics name the blocks as a pattern the user can paste: `blocks.*`, `blocks.3`, else `blocks.{0-3}`.
            which = "*" if len(idx) == rep.count else str(idx[0]) if len(idx) == 1 else _blocks_text(sorted(idx))
            flows = block_flows(rep, dict(key), reporter, f"{rep.name}.{which}")
            classes.append(BlockClass(tuple(sorted(idx)), key, tuple(flows)))
        return tuple(classes)

    # -- loss
    def loss(self, top: dict[str, Placement]) -> Placement:
        last = self.model.items[-1]
        head = top.get(last.name) if isinstance(last, Unit) and last.kind == "linear" else None
        logits = head if head is not None else REPLICATE
        inferred = Placement("vocab_parallel", logits.axes) if logits.rule == "column" and logits.sharded else REPLICATE
        stmt = self.single(ast.LossStmt, "`loss`")
        if head is not None and head.rule == "row" and head.sharded:
            self.error("E0404", f"`{last.name}` is row-parallel, so its logits are partial sums entering the loss",
                       head.span, label="logits are Partial over " + " x ".join(head.axes),
                       help=f"make `{last.name}` `column({', '.join(head.axes)})` with a vocab-parallel loss, or `replicate`")
            return inferred
        if stmt is None:
            return inferred
        name = stmt.rule.name.value
        if name not in ("cross_entropy", "vocab_parallel"):
            self.error("E0406", f"unknown loss `{name}`", stmt.rule.name.span, label="not a loss",
                       help="use `cross_entropy` or `vocab_parallel(AXIS)`")
            return inferred
        axes = self.check_axes(stmt.rule.axes, "the loss") if name == "vocab_parallel" else ()
        if axes is None:
            return inferred
        if name == "vocab_parallel" and inferred.axes != axes:
            got = "replicated (gathered)" if not inferred.sharded else f"sharded over {' x '.join(inferred.axes)}"
            self.error("E0404", f"the loss expects logits sharded over {' x '.join(axes) or 'nothing'} but they are {got}",
                       stmt.rule.span, label="loss layout", secondary=(Label(head.span, "logits placed here"),) if head and head.span else (),
                       help=f"shard `{last.name}` with `column({', '.join(axes)})`, or use `loss cross_entropy`")
        if name == "cross_entropy" and inferred.sharded:
            self.error("E0404", f"`cross_entropy` needs full logits but `{last.name}` shards them over {' x '.join(inferred.axes)}",
                       stmt.rule.span, label="expects replicated logits",
                       help=f"use `loss vocab_parallel({', '.join(inferred.axes)})`: it never gathers the logits")
        return inferred

    # -- pipeline
    def stages(self, top: dict[str, Placement], classes: tuple[BlockClass, ...]) -> tuple[tuple[Stage, ...], str | None, int]:
        stmts = [s for s in self.decl.body if isinstance(s, ast.StagesStmt)]
        model = self.model
        if not stmts:
            return (Stage(0, 0, tuple(StagePiece(i.name, 0 if isinstance(i, Repeat) else None, i.count if isinstance(i, Repeat) else None) for i in model.items), model.numel),), None, 1
        stmt = stmts[0]
        for extra in stmts[1:]:
            self.error("E0201", "`stages` is declared twice", extra.span, label="second declaration",
                       secondary=(Label(stmt.span, "first here"),), help="declare the stage map once")  # type: ignore[arg-type]
        axes = self.check_axes([stmt.axis], "stages")
        if axes is None:
            return (), None, 1
        axis = axes[0]
        p = self.mesh.size(axis)
        virtual = 1
        if stmt.virtual is not None:
            virtual = self.eval_int(stmt.virtual, {}, "virtual stages") or 1
        count = p * virtual
        if stmt.balanced:
            return self.balanced(stmt, axis, p, virtual), axis, virtual
        # Stage-map errors point at the map's header (`stages over AXIS`) or at the entry involved,
        # never at the whole multi-line map.
        header_end = stmt.virtual.span.end if stmt.virtual is not None and stmt.virtual.span else stmt.axis.span.end  # type: ignore[union-attr]
        header = stmt.span.source.span(stmt.span.start, header_end) if stmt.span else None
        errors_before = self.error_count()
        entries = list(stmt.entries)
        order_of = {i.name: k for k, i in enumerate(model.items)}
        indices = [e.index.value for e in entries]
        if indices != list(range(len(entries))):
            if sorted(indices) == list(range(len(entries))):
                # Numbered 0..n-1 but listed out of order: one error, then check the map in stage order.
                k, bad = next((k, e) for k, e in enumerate(entries) if e.index.value != k)
                self.error("E0603", f"stage {bad.index.value} is listed where stage {k} belongs", bad.index.span,
                           label=f"expected stage {k}",
                           help=f"list the stages in order {', '.join(map(str, range(len(entries))))}: "
                           "activations flow from stage i to stage i + 1")
                # Follow the numbering unless the listing is the one in layer order (then the numbers are the typo).
                by_index = sorted(entries, key=lambda e: e.index.value)
                if not _layer_ordered(entries, order_of) and _layer_ordered(by_index, order_of):
                    entries = by_index
            else:
                for k, e in enumerate(entries):
                    if e.index.value != k:
                        self.error("E0603", f"stage {e.index.value} is out of order", e.index.span,
                                   label=f"expected stage {k}", help="number stages 0, 1, 2, ... in order")
        stages: list[Stage] = []
        seen_items: dict[str, ast.StageItem] = {}
        last_item: dict[str, tuple[int, ast.StageItem]] = {}  # item -> (stage, its latest occurrence)
        order = {i.name: k for k, i in enumerate(model.items)}
        position = (-1, 0)  # (item order, next block) the next piece must start at
        # Pieces out of layer order: those outside a longest run in order, so one misplaced layer is one
        # error (not an error for every correct piece after it).
        listed = [it for e in entries for it in e.items if it.name.value in order]
        keep = _longest_ordered([(order[it.name.value], it.start or 0) for it in listed])
        out_of_order = {id(it) for i, it in enumerate(listed) if i not in keep}
        overlap_reported = False
        bad_ranges: set[str] = set()
        unknown_names = False
        for k, entry in enumerate(entries):
            pieces: list[StagePiece] = []
            for it in entry.items:
                name = it.name.value
                item = model.item(name)
                if item is None:
                    self.error("E0202", f"unknown layer `{name}` in the stage map", it.name.span, label="no such layer",
                               help=did_you_mean(name, [i.name for i in model.items]))
                    unknown_names = True  # the layers "in no stage" are then most likely this one, misspelled
                    continue
                if isinstance(item, Repeat):
                    start, stop = (it.start, it.stop) if it.start is not None else (0, item.count)
                    assert start is not None and stop is not None
                    if not (0 <= start < stop <= item.count):
                        bad_ranges.add(name)  # coverage of this repeat is then unknown: no E0601 / E0602 guesses
                        self.error("E0609", f"`{name}[{start}:{stop}]` is not a valid block range", it.span,
                                   label=f"`{name}` has blocks 0 to {item.count - 1}",
                                   help=f"use a range within [0:{item.count}] with start < stop")
                        continue
                else:
                    if it.start is not None:
                        self.error("E0609", f"`{name}` is a single layer and cannot be sliced", it.span,
                                   label="not a repeat", help=f"write `{name}` without a range")
                        seen_items.setdefault(name, it)  # it is in this stage, only mis-written
                        continue
                    start = stop = None  # type: ignore[assignment]
                    if name in seen_items:
                        self.error("E0602", f"`{name}` is in two stages", it.span, label="again here",
                                   secondary=(Label(seen_items[name].span, "first here"),),  # type: ignore[arg-type]
                                   help="every layer belongs to exactly one stage")
                        continue
                    seen_items[name] = it
                here = (order[name], start or 0)
                prev = last_item.get(name)
                if (isinstance(item, Repeat) and prev is not None and position[0] == order[name]
                        and start < position[1] and stop > (prev[1].start or 0)):
                    self.error("E0602", f"blocks {_blocks_text(range(start, min(stop, position[1])))} of `{name}` are in two stages",
                               it.span, label=f"starts at {start}",
                               secondary=(Label(prev[1].span, f"stage {prev[0]} holds blocks up to {position[1] - 1}"),),  # type: ignore[arg-type]
                               help=f"start this range at {position[1]}: every block belongs to exactly one stage")
                    overlap_reported = True
                elif id(it) in out_of_order:
                    self.error("E0603", f"`{it.name.value}{'' if start is None else f'[{start}:{stop}]'}` is out of order",
                               it.span, label="comes before an earlier stage's layers",
                               help="stages must hold the model's layers contiguously and in order")
                elif isinstance(item, Repeat) and here > position and position[0] == order[name]:
                    self.error("E0601", f"blocks {position[1]} to {start - 1} of `{name}` are in no stage", it.span,
                               label=f"starts at {start}", help=f"start this range at {position[1]}")
                elif isinstance(item, Repeat) and position[0] < order[name] and start != 0:
                    self.error("E0601", f"blocks 0 to {start - 1} of `{name}` are in no stage", it.span,
                               label=f"starts at {start}", help=f"start the first range of `{name}` at 0")
                if id(it) not in out_of_order:
                    position = max(position, (order[name], stop if stop is not None else 0) if isinstance(item, Repeat) else (order[name] + 1, 0))
                last_item[name] = (k, it)
                pieces.append(StagePiece(name, start, stop))
            if not pieces and not entry.items:
                self.error("E0605", f"stage {k} holds no layers", entry.span, label="empty stage",
                           help=f"every stage needs at least one layer: move layers here or use fewer stages (and a smaller `{axis}` axis)")
            stages.append(Stage(k, k % p, tuple(pieces), self.stage_numel(pieces, top)))
        # coverage of every item and every block
        for i, item in enumerate(model.items):
            if isinstance(item, Repeat) and item.name not in bad_ranges:
                counts = collections.Counter(
                    b for s in stages for pc in s.pieces if pc.item == item.name for b in range(pc.start or 0, pc.stop or 0))
                dup = sorted(b for b, c in counts.items() if c > 1)
                if dup and not overlap_reported:
                    self.error("E0602", f"blocks {_blocks_text(dup)} of `{item.name}` are in two stages", header,
                               label="overlapping ranges", help="block ranges of consecutive stages must not overlap")
                # Gaps and a late first range are reported where they occur (above); here only the tail.
                end = max(counts, default=-1) + 1
                if end < item.count:
                    where = last_item.get(item.name)
                    if where is None:
                        self.error("E0601", f"`{item.name}` (blocks 0-{item.count - 1}) is in no stage", header,
                                   label="stage map", help=f"add `{item.name}[a:b]` ranges covering `{item.name}[0:{item.count}]`")
                    else:
                        k, it = where
                        first = it.start if it.start is not None else 0
                        self.error("E0601", f"blocks {_blocks_text(range(end, item.count))} of `{item.name}` are in no stage",
                                   it.span, label=f"the last range stops at block {end - 1}",
                                   help=f"extend it to `{item.name}[{first}:{item.count}]`, or add `{item.name}[{end}:{item.count}]` to the next stage")
            elif not isinstance(item, Repeat) and item.name not in seen_items and not unknown_names:
                before = next((last_item[n.name] for n in reversed(model.items[:i]) if n.name in last_item), None)
                after = next((last_item[n.name] for n in model.items[i + 1:] if n.name in last_item), None)
                if before is not None:
                    k, it = before
                    self.error("E0601", f"`{item.name}` is in no stage", it.span, label=f"`{item.name}` comes after this",
                               help=f"add `{item.name}` after `{it.span.text if it.span else it.name.value}` in stage {k}"
                               + (f", or first in stage {k + 1}" if k + 1 < len(entries) else ""))
                elif after is not None:
                    k, it = after
                    self.error("E0601", f"`{item.name}` is in no stage", it.span, label=f"`{item.name}` comes before this",
                               help=f"add `{item.name}` before `{it.span.text if it.span else it.name.value}` in stage {k}")
                else:
                    self.error("E0601", f"`{item.name}` is in no stage", header, label="stage map",
                               help=f"add `{item.name}` to the first stage")
        if len(stmt.entries) != count:
            self.error("E0604", f"{len(stmt.entries)} stages for a pipeline of {count}", header,
                       label=f"{len(stmt.entries)} stage{'s' if len(stmt.entries) != 1 else ''} listed, {count} needed",
                       secondary=self.axis_label(axis),
                       help=f"declare exactly {count} stages ({axis} size {p}" + (f" x {virtual} virtual" if virtual > 1 else "") + ")")
        if self.error_count() == errors_before:
            # Balance is only meaningful for a valid stage map.
            worst = max(range(len(stages)), key=lambda k: stages[k].numel, default=0)
            self.imbalance(stages, entries[worst].span if entries else stmt.span)
        return tuple(stages), axis, virtual

    def balanced(self, stmt: ast.StagesStmt, axis: str, p: int, virtual: int) -> tuple[Stage, ...]:
        count = p * virtual
        rep = self.repeat
        if rep is None:
            self.error("E0608", "`balanced` needs a repeated block stack to split", stmt.span,
                       label="no repeat in this model", help="list the stages explicitly")
            return ()
        if rep.count % count:
            fits = [d for d in divisors(rep.count)]
            self.error("E0608", f"{rep.count} blocks cannot be split evenly over {count} stages", stmt.span,
                       label=f"{axis} = {p}" + (f" x virtual {virtual}" if virtual > 1 else ""),
                       secondary=self.axis_label(axis),
                       help=f"stage count ({axis} x virtual) must divide {rep.count}: use {or_list(fits)}, or list the stages explicitly")
            return ()
        per = rep.count // count
        order = [i.name for i in self.model.items]
        ri = order.index(rep.name)
        stages = []
        top_placeholder: dict[str, Placement] = {}
        for k in range(count):
            pieces = []
            if k == 0:
                pieces += [StagePiece(n) for n in order[:ri]]
            pieces.append(StagePiece(rep.name, k * per, (k + 1) * per))
            if k == count - 1:
                pieces += [StagePiece(n) for n in order[ri + 1 :]]
            stages.append(Stage(k, k % p, tuple(pieces), self.stage_numel(pieces, top_placeholder)))
        self.imbalance(stages, stmt.span)
        return tuple(stages)

    def stage_numel(self, pieces: Iterable[StagePiece], top: dict[str, Placement]) -> int:
        total = 0
        for pc in pieces:
            item = self.model.item(pc.item)
            if isinstance(item, Repeat):
                total += (pc.stop - pc.start) * item.numel_per_block  # type: ignore[operator]
            elif item is not None:
                total += item.numel
                for leaf in item.leaves:
                    if leaf.tie is not None:
                        tied = self.model.item(leaf.tie)
                        # A tied weight on another stage is held there too (a synchronised copy).
                        if tied is not None and all(q.item != leaf.tie for q in pieces):
                            total += tied.numel
        return total

    def imbalance(self, stages: Sequence[Stage], span: Span | None) -> None:
        if len(stages) < 2:
            return
        sizes = [s.numel for s in stages]
        mean = sum(sizes) / len(sizes)
        worst = max(stages, key=lambda s: s.numel)
        if mean and worst.numel > 1.25 * mean:
            listing = ", ".join(f"{_human(s.numel)}" for s in stages)
            self.warn("W0701", f"stage {worst.index} holds {worst.numel / mean:.2f}x the mean parameter count",
                      span, label=f"parameters per stage: {listing}",
                      help="the slowest stage sets the pace of the pipeline: move blocks off stage "
                      f"{worst.index}, or give the embedding / head stages fewer blocks",
                      note="the pipeline waits for its slowest stage")

    def schedule(self, pipeline_axis: str | None, virtual: int) -> str:
        stmt = self.single(ast.ScheduleStmt, "`schedule`")
        default = "interleaved_1f1b" if virtual > 1 else ("1f1b" if pipeline_axis else "gpipe")
        if stmt is None:
            return default
        name = stmt.name.value
        if name not in SCHEDULES:
            self.error("E0607", f"unknown schedule `{name}`", stmt.name.span, label="not a schedule",
                       help=f"use {or_list(f'`{s}`' for s in SCHEDULES)}")
            return default
        if name == "interleaved_1f1b" and virtual < 2:
            self.error("E0607", "`interleaved_1f1b` needs virtual stages", stmt.name.span, label="no `virtual N` on the stages",
                       help="write `stages over AXIS virtual 2 ...` (each rank then runs 2 stages)")
        if name != "interleaved_1f1b" and virtual > 1:
            self.error("E0607", f"virtual stages need the `interleaved_1f1b` schedule, not `{name}`", stmt.name.span,
                       label="does not interleave", help="use `schedule interleaved_1f1b`, or drop `virtual`")
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
            self.error("E0305", f"batch {batch} does not split into {parts}", span,
                       label=f"not a multiple of {dp * micro}",
                       secondary=(Label(settings["microbatches"].value.span, "microbatches here"),) if "microbatches" in settings and settings["microbatches"].value.span else (),  # type: ignore[arg-type]
                       help=f"batch must be a multiple of {dp * micro}: e.g. {or_list(ok)}")
        pipeline = len({s.coord for s in stages})
        if pipeline > 1 and micro < pipeline:
            ms = settings.get("microbatches")
            where = ms.value.span if ms is not None else self.decl.name.span
            if schedule in ("1f1b", "interleaved_1f1b"):
                self.error("E0606", f"`{schedule}` needs at least as many microbatches as pipeline stages ({micro} < {pipeline})",
                           where, label=f"{micro} microbatch{'es' if micro != 1 else ''}" if ms is not None else "`microbatches` is not set (so 1)",
                           help=f"{'use' if ms is not None else 'set'} `microbatches = {pipeline}` or more (and batch divisible by it)",
                           note="with fewer microbatches than stages 1F1B cannot fill the pipeline and hangs in torch")
            else:
                self.warn("W0703", f"{micro} microbatches for {pipeline} pipeline stages", where,
                          label="fewer microbatches than stages",
                          help=f"use at least {pipeline} (bubble is (p - 1) / (m + p - 1) = {(pipeline - 1) / (micro + pipeline - 1):.0%} now)")
        if schedule == "interleaved_1f1b" and pipeline > 1 and micro % pipeline:
            ms = settings.get("microbatches")
            self.error("E0606", f"`interleaved_1f1b` needs microbatches divisible by the pipeline size ({micro} % {pipeline} != 0)",
                       ms.value.span if ms is not None else self.decl.name.span, label=f"{micro} microbatches",
                       help=f"use a multiple of {pipeline}")

    def optimizer(self, batch_axes: tuple[str, ...]) -> tuple[str, tuple[tuple[str, object], ...], int, tuple[str, ...]]:
        stmts = [s for s in self.decl.body if isinstance(s, ast.OptimizerStmt)]
        if not stmts:
            return "adamw", (), 0, ()
        stmt = stmts[0]
        for extra in stmts[1:]:
            self.repeated("`optimizer`", extra.span, stmt.span)
        if stmt.name.value in ("adam", "sgd"):
            self.error("E0309", f"optimizer `{stmt.name.value}` is not supported yet", stmt.name.span,
                       label="the runtime builds AdamW", help="use `optimizer adamw { ... }` (with `weight_decay = 0` "
                       "it is Adam with decoupled decay switched off)")
        elif stmt.name.value != "adamw":
            self.error("E0203", f"unknown optimizer `{stmt.name.value}`", stmt.name.span, label="not an optimizer",
                       help="use `adamw`")
        settings = []
        seen: dict[str, ast.Setting] = {}
        for s in stmt.settings:
            if s.name.value not in _OPT_SETTINGS:
                self.error("E0203", f"unknown optimizer setting `{s.name.value}`", s.name.span, label="not a setting",
                           help=did_you_mean(s.name.value, _OPT_SETTINGS))
                continue
            if s.name.value in seen:
                self.repeated(f"optimizer setting `{s.name.value}`", s.name.span, seen[s.name.value].name.span)
                continue
            seen[s.name.value] = s
            low, high, low_open, high_open = _OPT_SETTINGS[s.name.value]
            v = self.eval_float(s.value, {}, f"`{s.name.value}`", low, high, low_open, high_open)
            if v is not None and s.name.value in _OPT_STEP_COUNTS and not float(v).is_integer():
                self.error("E0304", f"`{s.name.value}` is a number of steps, not {v}", s.value.span,
                           label="not a whole number", help=f"write `{s.name.value} = {int(v)}`")
                continue
            if v is not None:
                settings.append((s.name.value, v))
        zero, zero_axes = 0, ()
        if stmt.zero is not None:
            zero = stmt.zero.stage.value
            if zero not in (0, 1, 2, 3):
                self.error("E0203", f"ZeRO stage {zero} does not exist", stmt.zero.stage.span, label="not 0, 1, 2 or 3",
                           help="zero 1 shards optimizer states over the data-parallel axes (2 and 3, which also shard "
                           "gradients and parameters, are not supported yet)")
                zero = 0
            elif zero in (2, 3):
                self.error("E0309", f"ZeRO stage {zero} is not supported yet", stmt.zero.stage.span,
                           label="the runtime shards optimizer states only (ZeRO-1)",
                           help="use `zero 1`: it shards the optimizer states, the largest part (12 of 16 bytes per parameter)")
                zero = 0
            axes = self.check_axes(stmt.zero.axes, "zero") if stmt.zero.axes else batch_axes
            if axes is not None:
                zero_axes = axes
                if not batch_axes and zero:
                    self.error("E0407", "ZeRO shards over the data-parallel axes, but this plan has none",
                               stmt.zero.span, label=f"zero {zero}",
                               help="add `layout { batch -> data }` so the batch (and the optimizer states) split over an axis")
                elif set(axes) != set(batch_axes) and zero:
                    self.error("E0407", f"ZeRO must shard over the batch axes ({' x '.join(batch_axes)}), not {' x '.join(axes)}",
                               stmt.zero.span, label="not the data-parallel axes",
                               help=f"write `zero {zero} over {' * '.join(batch_axes)}`: only ranks holding the same parameters can share their optimizer states")
        return stmt.name.value, tuple(settings), zero, zero_axes

    def sharding_warnings(self, top: dict[str, Placement], classes: tuple[BlockClass, ...]) -> None:
        """Pitfalls of a valid plan: a split that splits nothing (W0705), splits too fine (W0706), or a
        sharding group larger than a host when the mesh does not say how many hosts (W0707)."""
        placed: list[tuple[str, Leaf | None, Placement]] = [(k, self._top_leaf(k), p) for k, p in top.items()]
        rep = self.repeat
        for c in classes:
            which = "*" if rep is not None and len(c.indices) == rep.count else _blocks_text(c.indices)
            placed += [(f"{rep.name}.{which}.{path}", self._block_leaf(path), p) for path, p in c.placements]  # type: ignore[union-attr]
        warned: set[tuple[str, object]] = set()
        for path, leaf, p in placed:
            if leaf is None or not p.sharded or not leaf.params:
                continue
            n = self.mesh.size(*p.axes)
            axes = " x ".join(p.axes)
            where = p.span.start if p.span is not None else None
            if n == 1:
                if ("W0705", p.axes) not in warned:
                    warned.add(("W0705", p.axes))
                    self.warn("W0705", f"`{path}` is split over {axes}, of size 1", p.span,
                              label="splits nothing", secondary=tuple(lab for a in p.axes for lab in self.axis_label(a)),
                              help="use `replicate`, or give the axis a size above 1")
                continue
            w = leaf.params[0]
            full = w.shape[1] if p.rule == "row" and len(w.shape) > 1 else w.shape[0]
            if full >= 1024 and full // n < 128 and ("W0706", where) not in warned:
                warned.add(("W0706", where))
                self.warn("W0706", f"`{path}` keeps {full // n} of {full} columns per device over {axes} ({n})", p.span,
                          label="over-sharded", secondary=tuple(lab for a in p.axes for lab in self.axis_label(a)),
                          help=f"use {axes} of at most {max(1, full // 128)} and give the devices to data parallelism "
                          "(`meshc plan` shows the communication time)")
            if (self.per_host is not None and self.mesh.hosts == 1 and n > self.per_host
                    and ("W0707", p.axes) not in warned):
                warned.add(("W0707", p.axes))
                self.warn("W0707", f"`{path}` is split over {n} devices, more than the {self.per_host} of one "
                          f"`{self.mesh.device or 'h100'}` host", p.span, label="collectives cross hosts",
                          secondary=tuple(lab for a in p.axes for lab in self.axis_label(a)),
                          help=f"declare `hosts` on mesh `{self.mesh.name}` and keep this axis within {self.per_host} devices")

    def _top_leaf(self, path: str) -> Leaf | None:
        return next((leaf for item, _, leaf in self.model.leaves() if not isinstance(item, Repeat)
                     and ".".join(leaf.path) == path), None)

    def _block_leaf(self, path: str) -> Leaf | None:
        return next((leaf for item, _, leaf in self.model.leaves() if isinstance(item, Repeat)
                     and ".".join(leaf.path) == path), None)

    def axis_usage(self, top: dict[str, Placement], classes: tuple[BlockClass, ...], pipeline_axis: str | None,
                   batch_axes: tuple[str, ...]) -> None:
        shard_axes: dict[str, Span | None] = {}
        for p in [*top.values(), *(pl for c in classes for _, pl in c.placements)]:
            for a in p.axes:
                shard_axes.setdefault(a, p.span)
        roles: dict[str, str] = {}
        if pipeline_axis:
            roles[pipeline_axis] = "the pipeline"
        for a in batch_axes:
            if a in roles:
                self.error("E0407", f"axis `{a}` is both {roles[a]} and a batch axis", self.decl.name.span,
                           label=f"plan `{self.decl.name.value}`", help="give each mesh axis one role")
            roles.setdefault(a, "a batch axis")
        for a, span in shard_axes.items():
            if a in roles:
                self.error("E0407", f"axis `{a}` is {roles[a]}; parameters cannot also be sharded over it", span,
                           label=f"shards over `{a}`",
                           help="shard parameters over a separate tensor axis; to save memory on the data axis shard the optimizer states: `optimizer adamw { zero 1 }`")
            if self.mesh.hosts > 1 and self.mesh.crosses_hosts(a):
                self.warn("W0702", f"tensor-parallel axis `{a}` spans hosts", span, label="collectives cross the network every layer",
                          secondary=self.axis_label(a),
                          help="put the tensor axis last in `axes` (last varies fastest) and keep its size within devices per host "
                          f"({self.mesh.devices_per_host})")
        used = set(shard_axes) | set(roles)
        # An axis looks unused when the rule or stage map using it was rejected: warn only on clean plans.
        for a in (self.mesh.axes if not self.failed else ()):
            if a.name not in used and a.size > 1:
                self.warn("W0704", f"mesh axis `{a.name}` is not used by plan `{self.decl.name.value}`", self.decl.name.span,
                          label="every rank along it does identical work", secondary=self.axis_label(a.name),
                          help=f"use it: `layout {{ batch -> {a.name} }}` for data parallelism, a `shard` rule, or `stages over {a.name}`")


def _layer_ordered(entries: Sequence[ast.StageEntry], order: dict[str, int]) -> bool:
    keys = [(order[e.items[0].name.value], e.items[0].start or 0) for e in entries if e.items and e.items[0].name.value in order]
    return keys == sorted(keys)


def _longest_ordered(keys: Sequence[tuple[int, int]]) -> set[int]:
    """Indices of a longest non-decreasing subsequence of `keys` (patience sorting, O(n log n))."""
    import bisect

    tails: list[tuple[int, int]] = []
    tail_index: list[int] = []
    parent = [-1] * len(keys)
    for i, key in enumerate(keys):
        j = bisect.bisect_right(tails, key)
        if j == len(tails):
            tails.append(key)
            tail_index.append(i)
        else:
            tails[j], tail_index[j] = key, i
        parent[i] = tail_index[j - 1] if j else -1
    out: set[int] = set()
    i = tail_index[-1] if tail_index else -1
    while i >= 0:
        out.add(i)
        i = parent[i]
    return out


class _Silent:
    def error(self, code: str, message: str, span: Span | None, **kw: object) -> None:
        pass


def _seg_matches(seg: ast.PathSegment, name: str) -> bool:
    if seg.kind == "star":
        return True
    if seg.kind in ("name", "alt"):
        return name in seg.names
    return False


def _blocks_text(blocks: Iterable[int]) -> str:
    """Block indices as a path segment: `3` or `{0-3,5}`."""
    xs = list(blocks)
    if not xs:
        return "{}"
    return str(xs[0]) if len(xs) == 1 else "{" + ranges(xs) + "}"


def _plural(word: str) -> str:
    return word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)
