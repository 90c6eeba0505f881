"""Shard rules and layout entries -> one placement per parameter: coverage (E0501), overlap (E0503),
rule fit (E0405 / E0406), divisibility (E0301), tied weights (E0408), block classes with their activation
layouts (layouts.py), and the loss's layout (E0404)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.checker.context import (
    PlanContext,
    _blocks_text,
    _Match,
    _seg_matches,
    _Silent,
)
from meshllm_dsl.checker.paths import match_layer_path, match_path
from meshllm_dsl.codes import (
    E0201,
    E0301,
    E0309,
    E0401,
    E0404,
    E0405,
    E0406,
    E0408,
    E0412,
    E0501,
    E0502,
    E0503,
)
from meshllm_dsl.diagnostics import Applicability, Label, Suggestion, make_rule, replace, typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.names import did_you_mean, divisors, or_list
from meshllm_dsl.ir import REPLICATE, RULES, BlockClass, Leaf, Placement, Repeat, Unit
from meshllm_dsl.parallel.layouts import block_flows


class PlacementRules(PlanContext):
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
                    self.error(E0201, f"`{dim}` is laid out twice", e.dim.span, label="second entry",
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
                if dim == "seq":  # sequence parallelism (checker/memory.py)
                    self.seq_axes, self.seq_entry = axes, e
                    continue
                if dim == "experts" and self.stacked_experts():
                    # Expert parallelism: the stacked experts split along their experts dim; the
                    # router (whose rows are the experts too) stays whole on every rank.
                    self.expert_axes, self.expert_entry = axes, e
                    continue
                hits = self.layout_leaves(dim, axes, e)
                if not hits:
                    known = sorted({u[0] for _, _, leaf in self.model.leaves() if leaf.shardable for u in leaf.in_units + leaf.out_units} | {"batch", "seq"})
                    self.error(E0502, f"layout entry `{dim}` matches no parameter", e.dim.span,
                               label="no layer has this dim", **typo(e.dim.span, dim, known))
                out.extend(hits)
        self._context_or_sequence()
        self.expert_rules()
        self.expert_parallel(batch_axes, self.context_axes)
        return batch_axes, out

    def expert_rules(self) -> None:
        """`shard PATH expert(D)`, the rule-style plans' `experts -> D`: PATH names the moe layers,
        whose stacked experts then split over D exactly as the layout entry splits them. One
        placement of the experts per plan, covering every moe layer (the runtime and the planner
        keep one expert group per plan)."""
        units = {id(leaf): unit for _, unit, leaf in self.model.leaves()}
        stacked = set(self.stacked_experts())
        for stmt in self.decl.body:
            if not isinstance(stmt, ast.ShardStmt) or stmt.rule.name.value != "expert":
                continue
            if not stmt.rule.axes:
                self.error(E0406, "`expert` needs the mesh axes to split the experts over", stmt.rule.span,
                           label="no axes given", help="e.g. `expert(data)`: a batch axis, as `experts -> data`")
                continue
            axes = self.check_axes(stmt.rule.axes, "`expert`")
            # the layers (`blocks.*.mlp`), or their weights named one by one
            hits = match_layer_path(stmt.path, self.model) or self.rule_matches(stmt.path)
            if axes is None or not hits:
                continue
            other = next((leaf for leaf, _ in hits if not primitives.of(units[id(leaf)]).routes_experts), None)
            if other is not None or not any(leaf in stacked for leaf, _ in hits):
                what = (f"`{stmt.path}` is not a moe layer (`{units[id(other)].name}` is {units[id(other)].kind})"
                        if other is not None else f"`{stmt.path}` names no experts of its moe layer")
                self.error(E0405, f"`expert` splits a moe layer's experts; {what}", stmt.rule.span,
                           label="no experts here",
                           help="name the moe layers, e.g. `shard blocks.*.mlp expert(...)`" if stacked else
                           f"model `{self.model.name}` has no moe layer: use `column`, `row` or `replicate`")
                continue
            covered = {leaf for leaf, blocks in hits if blocks is None and leaf in stacked}
            if covered != stacked:
                self.error(E0309, f"`expert` on some moe layers only (`{stmt.path}`) is not supported yet",
                           stmt.path.span, label="not every moe layer", help="split every moe layer's experts alike: "
                           "name all of them (e.g. `blocks.*.mlp`)")
                continue
            first = self.expert_entry
            if first is not None:
                said = ("`experts -> ...` in the layout" if isinstance(first, ast.LayoutEntry)
                        else f"`{first.path} expert(...)`")
                self.error(E0412, f"the experts are split twice: by `{stmt.path} expert(...)` and by {said}",
                           stmt.rule.span, label="second placement of the experts",
                           secondary=(Label(first.span, "first here"),),  # type: ignore[arg-type]
                           help="keep one: `layout { experts -> D }` and `shard PATH expert(D)` say the same")
                continue
            self.expert_axes, self.expert_entry = axes, stmt

    def _context_or_sequence(self) -> None:
        """`seq -> AXES`: Megatron sequence parallelism over the axes that split weights (tensor
        axes), context parallelism over those that split none. `seq -> tensor * cp` is both at once
        (Megatron's --context-parallel-size with --sequence-parallel): the sequence is split over cp
        through the whole model and, in the norm / residual regions, further over tensor."""
        e = self.seq_entry
        if e is None:
            return
        weight_axes = self.weight_axes()
        self.context_axes = tuple(a for a in self.seq_axes if a not in weight_axes)
        self.seq_axes = tuple(a for a in self.seq_axes if a in weight_axes)

    def weight_axes(self) -> set[str]:
        """The axes the layout entries and shard rules split some weight's dims over (tensor axes).
        The experts' placement splits no weight's dims: experts over a context axis (expert
        parallelism over the context ranks' tokens) leave it a context axis."""
        axes = {a.value for stmt in self.decl.body if isinstance(stmt, ast.ShardStmt)
                and stmt.rule.name.value != "expert" for a in stmt.rule.axes}
        return axes | {a.value for stmt in self.decl.body if isinstance(stmt, ast.LayoutStmt)
                       for x in stmt.entries if x.dim.value not in ("batch", "seq", "experts") for a in x.axes}

    def stacked_experts(self) -> list[Leaf]:
        """The model's stacked experts weights ([out, experts, in]): what `experts -> D` splits."""
        return [leaf for _, _, leaf in self.model.leaves() if any(
            len(t.units) == 3 and any(u[0] == "experts" for u in t.units[1]) for t in leaf.params)]

    def expert_parallel(self, batch_axes: tuple[str, ...], context_axes: tuple[str, ...] = ()) -> None:
        """`experts -> D`: D among the batch and context axes (tokens differ along them, so they
        travel to other ranks' experts) and the tensor axes (tokens the same along them: each
        tensor rank first takes its 1 / |T| of them, torchtitan's EP over dp_shard x cp x tp),
        and the experts dividing over D. Not a sequence-parallel axis (the moe layer refuses
        sequence parallelism's collectives)."""
        e, axes = self.expert_entry, self.expert_axes
        if e is None:
            return
        weights = self.weight_axes()
        allowed = tuple(a.name for a in self.mesh.axes if a.name in batch_axes or a.name in context_axes
                        or (a.name in weights and a.name not in self.seq_axes))
        outside = [a for a in axes if a not in allowed]
        if outside:
            fix = (f"`experts -> {' * '.join(allowed)}`" if isinstance(e, ast.LayoutEntry)
                   else f"`shard {e.path} expert({', '.join(allowed)})`")
            sp = [a for a in outside if a in self.seq_axes]
            self.error(E0412, f"expert parallelism over {' x '.join(outside)}, "
                       + (f"which sequence parallelism splits the tokens over ({' x '.join(sp)}): the moe layers "
                          "take whole sequences" if sp else
                          "which is neither a batch, a context nor a tensor axis" if len(outside) == 1
                          else "which are neither batch, context nor tensor axes"),
                       e.span if isinstance(e, ast.LayoutEntry) else e.rule.span, label="tokens do not differ along it",
                       help=f"split the experts over batch, context or tensor axes ({', '.join(allowed) or 'none yet'}): "
                       + (fix if allowed else f"add `batch -> {', '.join(axes)}` to the layout")
                       + "; to split each expert's ffn over a tensor axis use `ffn -> AXIS`")
        n = self.mesh.size(*axes)
        counts = sorted({c for leaf in self.stacked_experts() for t in leaf.params for _, c in t.units[1]})
        bad = [c for c in counts if c % n]
        if bad:
            self.error(E0301, f"`experts` ({bad[0]}) is not divisible by {' x '.join(axes)} ({n})", e.span,
                       label=f"splits {bad[0]} experts over {n} devices",
                       secondary=tuple(lab for a in axes for lab in self.axis_label(a)),
                       help=f"{' x '.join(axes)} must divide the experts: use {or_list(divisors(math.gcd(*counts)))}",
                       suggestions=self.resize_axis(axes, divisors(math.gcd(*counts))))

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
                self.error(E0401, f"`{dim} -> {' * '.join(axes)}` would split both dims of `{'.'.join(leaf.path)}`",
                           e.span, label="both input and output are this dim",
                           help="shard this layer with an explicit `shard` rule instead")
                self.claimed.add(leaf)
                continue
            if out_hit:
                rule = "vocab_parallel" if primitives.of_leaf(leaf).vocab_rows else "column"
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
            if not isinstance(stmt, ast.ShardStmt) or stmt.rule.name.value == "expert":  # expert_rules'
                continue
            placement = self.rule(stmt.rule)
            hits = self.rule_matches(stmt.path)
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
            self.error(E0406, f"unknown sharding rule `{name}`", rule.name.span, label="not a rule",
                       help=f"use {or_list(f'`{r}`' for r in RULES)}",
                       suggestions=tuple(s for r in RULES for s in (
                           replace(rule.span, r, f"Use `{r}`") if r == "replicate" else replace(rule.name.span, r, f"Use `{r}`"))))
            return None
        if name == "replicate":
            if rule.axes:
                self.error(E0406, "`replicate` takes no axes", rule.span, label="remove the axes",
                           help="`replicate` keeps a full copy on every device",
                           suggestions=replace(rule.span, "replicate", "Remove the axes", Applicability.MACHINE_APPLICABLE))
                return None
            return Placement("replicate", (), rule.span)
        if not rule.axes:
            self.error(E0406, f"`{name}` needs the mesh axes to shard over", rule.span, label="no axes given",
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
            self.error(E0405, f"`{path}` is a {leaf.kind}; it cannot be sharded with `{p.rule}`", stmt.rule.span,
                       label="not shardable", help=f"{leaf.kind} parameters are small and stay replicated: use `replicate` or remove the rule",
                       suggestions=make_rule(stmt.rule.span, "replicate"))
            return False
        if primitives.of_leaf(leaf).vocab_rows and p.rule != "vocab_parallel":
            self.error(E0405, f"embedding `{path}` can only be `vocab_parallel` or `replicate`", stmt.rule.span,
                       label=f"`{p.rule}` is not supported for embeddings",
                       help=f"use `vocab_parallel({', '.join(p.axes)})`: it splits the vocabulary rows",
                       suggestions=make_rule(stmt.rule.span, f"vocab_parallel({', '.join(p.axes)})"))
            return False
        if not primitives.of_leaf(leaf).vocab_rows and p.rule == "vocab_parallel":  # (a linear: the shardable leaf kinds are linear and embedding)
            self.error(E0405, f"`vocab_parallel` applies to embeddings; `{path}` is a linear layer", stmt.rule.span,
                       label="not an embedding",
                       help=f"use `column({', '.join(p.axes)})`: for an output projection it splits the vocabulary",
                       suggestions=make_rule(stmt.rule.span, f"column({', '.join(p.axes)})"))
            return False
        return True

    def rule_matches(self, path: ast.Path) -> list[tuple[Leaf, frozenset[int] | None]]:
        """Leaves a pattern matches, with the blocks it covers for leaves inside the repeat."""
        segs = path.segments
        hits = self.path_hits(segs)
        if hits:
            # every alternative in `{a,b}` must name something, or the rule silently matches less
            for s in segs:
                if s.kind == "alt":
                    for n in s.names:
                        if not any(n in (leaf.path) or (isinstance(item, Repeat) and n == item.name)
                                   for item, _, leaf in self.model.leaves()):
                            self.error(E0502, f"`{n}` in `{path}` matches no layer", s.span, label=f"no layer `{n}`",
                                       help=did_you_mean(n, {p for _, _, lf in self.model.leaves() for p in lf.path}))
            return hits
        corrected = self.corrected_path(segs)
        if corrected is not None:
            fixed, meant = corrected
            typos = [n for s, f in zip(segs, fixed) for n in s.names if n not in f.names]
            self.error(E0502, f"rule `{path}` matches no layer", path.span,
                       label=f"no layer {_and_list(f'`{n}`' for n in typos)} here",
                       help=f"did you mean `{'.'.join(str(s) for s in fixed)}`?",
                       suggestions=replace(path.span, '.'.join(str(s) for s in fixed)))
            # What the rule was meant to place is not also "placed by no rule" (E0501): that follows
            # from this typo alone, so it becomes a note here (placements() fills it in).
            for leaf, _blocks in meant:
                self.folded.setdefault(leaf, len(self.diagnostics) - 1)
            return []
        self.error(E0502, f"rule `{path}` matches no layer", path.span, label="matches nothing",
                   help=self.path_help(path))
        return []

    def corrected_path(self, segs: tuple[ast.PathSegment, ...]):  # type: ignore[no-untyped-def]
        """The pattern with each name no layer has at its place replaced by the closest one that
        is there, and what that matches; None when no such correction matches anything."""
        names_at: dict[int, set[str]] = {}
        for item, _, leaf in self.model.leaves():
            full = (item.name, "*", *leaf.path) if isinstance(item, Repeat) else leaf.path
            if len(full) == len(segs):
                for i, n in enumerate(full):
                    names_at.setdefault(i, set()).add(n)
        fixed = list(segs)
        changed = False
        for i, seg in enumerate(segs):
            if seg.kind not in ("name", "alt"):
                continue
            names = []
            for n in seg.names:
                known = names_at.get(i, set())
                if n not in known:
                    close = difflib.get_close_matches(n, sorted(known), n=1, cutoff=0.6)
                    if not close:
                        return None
                    n, changed = close[0], True
                names.append(n)
            fixed[i] = ast.PathSegment(seg.kind, tuple(names), seg.index, seg.span)
        if not changed:
            return None
        meant = self.path_hits(tuple(fixed))
        return (fixed, meant) if meant else None

    def path_hits(self, segs: tuple[ast.PathSegment, ...]) -> list[tuple[Leaf, frozenset[int] | None]]:
        return match_path(segs, self.model)

    def path_help(self, path: ast.Path) -> str:
        segs = path.segments
        for rep in self.model.repeats:
            if segs and _seg_matches(segs[0], rep.name) and len(segs) > 1 and segs[1].kind == "index":
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
        expert_leaves = set(self.stacked_experts()) if self.expert_entry is not None else set()

        split_tokens = [a for a in self.expert_axes if a in self.weight_axes()]
        refused: set[str] = set()

        def ep(leaf: Leaf, p: Placement | None) -> Placement | None:
            # `experts -> D` adds its split to whatever rule (or none) places the stacked weight.
            if p is None and leaf in expert_leaves:
                p = attrs.evolve(REPLICATE, span=self.expert_entry.span)  # type: ignore[union-attr]
            if p is not None and leaf in expert_leaves and p.sharded and split_tokens and not refused:
                # Experts over a tensor axis take 1 / |T| of the tokens each (expert-tensor
                # parallelism 1, as torchtitan's etp = 1): each expert's ffn is whole.
                refused.add(leaf.name)
                e = self.expert_entry
                self.error(E0412, f"the experts are split over {' x '.join(split_tokens)}, a tensor axis, and their "
                           f"ffn over {' x '.join(p.axes)} too", p.span, label="splits each expert's ffn",
                           secondary=(Label(e.span if isinstance(e, ast.LayoutEntry) else e.rule.span,  # type: ignore[union-attr]
                                            "the experts over a tensor axis"),),
                           help="with the experts over a tensor axis each of its ranks routes its share of the "
                           "tokens to whole experts (torchtitan's etp = 1): drop the experts' ffn split, or keep "
                           "the experts over batch and context axes and split their ffn over tensor")
            return attrs.evolve(p, experts=self.expert_axes) if p is not None and leaf in expert_leaves else p
        top: dict[str, Placement] = {}
        missing_rules: list[tuple[Leaf, Unit, str, str]] = []
        # per repeat: a leaf's path in the block -> its placement in most blocks, and per block where it differs
        per_leaf_default: dict[str, dict[tuple[str, ...], Placement]] = {r.name: {} for r in self.model.repeats}
        per_leaf_exceptions: dict[str, dict[tuple[str, ...], dict[int, Placement]]] = {r.name: {} for r in self.model.repeats}
        for item, _unit, leaf in self.model.leaves():
            ms = by_leaf.get(leaf, [])
            in_repeat = isinstance(item, Repeat)
            self.overlaps(leaf, ms, item)
            full = ".".join(leaf.path)
            if in_repeat:
                default = ep(leaf, next((m.placement for m in ms if m.blocks is None), None))
                exceptions: dict[int, Placement] = {}
                for m in ms:
                    if m.blocks is not None:
                        for b in m.blocks:
                            exceptions.setdefault(b, ep(leaf, m.placement))  # type: ignore[arg-type]
                if default is None and any_rules and leaf.shardable and leaf not in self.claimed:
                    missing = [b for b in range(item.count) if b not in exceptions]
                    if missing:
                        pattern = f"{item.name}.{'*' if len(missing) == item.count else missing[0]}.{full}"
                        missing_rules.append((leaf, _unit, f"{item.name}.{_blocks_text(missing)}.{full}", pattern))
                per_leaf_default[item.name][leaf.path] = default or REPLICATE
                per_leaf_exceptions[item.name][leaf.path] = exceptions
                placements = [default or REPLICATE, *exceptions.values()]
            else:
                if not ms and any_rules and leaf.shardable and leaf not in self.claimed and leaf not in expert_leaves:
                    missing_rules.append((leaf, _unit, full, full))
                top[full] = ep(leaf, ms[0].placement if ms else REPLICATE)  # type: ignore[assignment]
                placements = [top[full]]
            for p in placements:
                self.divisibility(leaf, p)
        self.uncovered(missing_rules, by_leaf)
        self.unplaced = bool(missing_rules)
        self.tied(top)
        classes = tuple(cls for rep in self.model.repeats
                        for cls in self.block_classes(rep, per_leaf_default[rep.name], per_leaf_exceptions[rep.name]))
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
            self.error(E0503, f"`{where}` is matched by two rules", a.span, label=f"{a.text} also matches it",
                       secondary=(Label(b.span, f"first matched by {b.text}"),) if b.span else (),
                       help="make the patterns disjoint: every parameter must be placed by exactly one rule")
            return

    def uncovered(self, missing: list[tuple[Leaf, Unit, str, str]], by_leaf: dict[Leaf, list[_Match]]) -> None:
        """E0501 for the parameters no rule places: a note on the misspelt rule that was meant to
        place them, else one diagnostic (all of them, with the layout keys or rules that place them)."""
        by_root: dict[int, list[str]] = {}
        rest = []
        for leaf, unit, where, pattern in missing:
            if leaf in self.folded:
                by_root.setdefault(self.folded[leaf], []).append(where)
            else:
                rest.append((leaf, unit, where, pattern))
        for index, wheres in by_root.items():
            root = self.diagnostics[index]
            self.diagnostics[index] = attrs.evolve(root, note=(
                f"so {_and_list(f'`{w}`' for w in wheres)} {'is' if len(wheres) == 1 else 'are'} placed by no rule "
                "(E0501): the corrected pattern places them"))
        if not rest:
            return
        # Suggest the rule that fits each leaf's role: the last projection of attention / mlp is row,
        # the others column, an embedding vocab_parallel, over the axes the plan shards most over.
        counts: dict[tuple[str, ...], int] = {}
        for ms in by_leaf.values():
            for m in ms:
                if m.placement.sharded:
                    counts[m.placement.axes] = counts.get(m.placement.axes, 0) + 1
        axes = ", ".join(max(counts, key=lambda a: counts[a])) if counts else None
        rules = {}
        for leaf, unit, _where, pattern in rest:
            if axes is None:
                rules[pattern] = "replicate"
            elif leaf.name in primitives.of(unit).whole:
                rules[pattern] = "replicate"
            elif primitives.of_leaf(leaf).vocab_rows:
                rules[pattern] = f"vocab_parallel({axes})"
            elif len(unit.leaves) > 1 and leaf is unit.leaves[-1]:
                rules[pattern] = f"row({axes})"
            else:
                rules[pattern] = f"column({axes})"
        if len(rest) == 1:
            leaf, _unit, where, pattern = rest[0]
            fix = (f"add `shard {pattern} {rules[pattern]}` (or `replicate` to keep a full copy)"
                   if axes is not None and rules[pattern] != "replicate"
                   else f"add `shard {pattern} replicate`")
            self.error(E0501, f"`{where}` is not placed by any rule", self.decl.name.span,
                       label=f"plan `{self.decl.name.value}` leaves it out",
                       secondary=(Label(leaf.span, f"`{leaf.name}` declared here"),) if leaf.span else (),
                       help=f"{fix}; a plan with rules must place every parameter",
                       suggestions=self.add_statement(f"shard {pattern} {rules[pattern]}"))
            return
        # (not where a leaf must stay whole: its dim in the layout would split it)
        whole = any(leaf.name in primitives.of(unit).whole for leaf, unit, _, _ in rest)
        keys = self.layout_keys(rest) if axes is not None and "," not in axes and not whole else None
        if keys is not None:
            fix = (f"add {', '.join(f'`{k} -> {axes}`' for k in keys)} to the layout (or a `shard` rule, or "
                   "`replicate`, for each)")
        else:
            fix = "add " + "; ".join(f"`shard {pattern} {rule}`" for pattern, rule in rules.items()) + (
                " (or `replicate` to keep a full copy)" if axes is not None else "")
        layout = self.single_layout()
        self.error(E0501, f"{len(rest)} parameters are not placed by any rule", self.decl.name.span,
                   label=f"plan `{self.decl.name.value}` leaves them out",
                   secondary=(Label(layout.span, "places only the dims it names"),) if layout is not None and layout.span else (),
                   note="not placed: " + ", ".join(f"`{where}`" for _, _, where, _ in rest),
                   help=f"{fix}; a plan with rules must place every parameter")

    def single_layout(self) -> ast.LayoutStmt | None:
        return next((s for s in self.decl.body if isinstance(s, ast.LayoutStmt)), None)

    def layout_keys(self, rest: list[tuple[Leaf, Unit, str, str]]) -> list[str] | None:
        """The layout entries that would place every leaf of `rest` (None when some leaf has none, or
        the plan has no layout to add them to): a column / vocab-parallel leaf is placed by its output
        dim, the row layer closing a unit by its input dim."""
        layout = self.single_layout()
        if layout is None:
            return None
        given = {e.dim.value for e in layout.entries}
        keys: list[str] = []
        for leaf, unit, _where, _pattern in rest:
            row = not primitives.of_leaf(leaf).vocab_rows and len(unit.leaves) > 1 and leaf is unit.leaves[-1]
            units = leaf.in_units if row else leaf.out_units[:1]
            if not units or units[0][0] in given:
                return None
            dim = units[0][0]
            other = leaf.out_units[:1] if row else leaf.in_units
            if any(u[0] == dim for u in other):  # both dims: a layout entry cannot place it (E0401)
                return None
            if dim not in keys:
                keys.append(dim)
        return keys

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
                E0301,
                f"{names} {'is' if len(failing) == 1 else 'are'} not divisible by {axes_text} ({n})",
                p.span,
                label=f"splits {count} {unit_name} over {n} devices",
                secondary=tuple(lab for a in p.axes for lab in self.axis_label(a)),
                help=f"{axes_text} must divide {listing}{also}: use {or_list(divisors(common))}"
                + (self.vocab_padding(count, n) if unit_name == "vocab" else ""),
                suggestions=self.resize_axis(p.axes, divisors(common)),
            )

    def vocab_padding(self, count: int, n: int) -> str:
        """The padding that makes the vocabulary split: the model keeps its real size as `vocab_used`
        (the stdlib families' parameter; `used` of `embedding` otherwise), so the padded rows are
        never a token (masked out of the softmax, the loss and the argmax)."""
        padded = -(-count // n) * n
        if "vocab_used" in dict(self.model.values):
            how = f"`vocab = {padded}, vocab_used = {count}` in the model"
        else:
            how = f"`embedding({padded}, ..., used = {count})`"
        return f", or pad `vocab` to {padded} (a multiple of {n}) and keep the real size: {how}; padded rows are never a token"

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
                self.error(E0408, f"`{leaf.name}` shares its weight with `{leaf.tie}` but is placed differently",
                           mine.span or leaf.span, label=f"{mine.rule}{'(' + ', '.join(mine.axes) + ')' if mine.axes else ''}",
                           secondary=(Label(theirs.span, f"`{leaf.tie}` is {theirs.rule}"),) if theirs.span else (),
                           help=(f"make `{leaf.name}` `column({', '.join(theirs.axes)})` to split the same vocabulary rows as `{leaf.tie}`, or replicate both"
                                 if theirs.sharded else
                                 f"make `{leaf.tie}` `vocab_parallel({', '.join(mine.axes)})` to split the same vocabulary rows as `{leaf.name}`, or replicate both"),
                           suggestions=_tie_fixes(mine, theirs))

    def block_classes(self, rep: Repeat, default: dict[tuple[str, ...], Placement],
                      exceptions: dict[tuple[str, ...], dict[int, Placement]]) -> tuple[BlockClass, ...]:
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
            # So too with a parameter no rule places (E0501): the plan has not said its layout yet.
            reporter = _Silent() if self.ambiguous or self.unplaced else self
            # Diagnostics name the blocks as a pattern the user can paste: `blocks.*`, `blocks.3`, else `blocks.{0-3}`.
            which = "*" if len(idx) == rep.count else str(idx[0]) if len(idx) == 1 else _blocks_text(sorted(idx))
            flows = block_flows(rep, dict(key), reporter, f"{rep.name}.{which}", self.seq_axes,
                                self.seq_entry.span if self.seq_entry else None)
            classes.append(BlockClass(rep.name, tuple(sorted(idx)), key, tuple(flows)))
        return tuple(classes)

    # -- loss
    def loss(self, top: dict[str, Placement]) -> Placement:
        last = self.model.items[-1]
        head = top.get(last.name) if isinstance(last, Unit) and primitives.of(last) is primitives.linear.LINEAR else None
        logits = head if head is not None else REPLICATE
        inferred = Placement("vocab_parallel", logits.axes) if logits.rule == "column" and logits.sharded else REPLICATE
        stmt = self.single(ast.LossStmt, "`loss`")
        if head is not None and head.rule == "row" and head.sharded:
            self.error(E0404, f"`{last.name}` is row-parallel, so its logits are partial sums entering the loss",
                       head.span, label="logits are Partial over " + " x ".join(head.axes),
                       help=f"make `{last.name}` `column({', '.join(head.axes)})` with a vocab-parallel loss, or `replicate`",
                       suggestions=make_rule(head.span, f"column({', '.join(head.axes)})") + make_rule(head.span, "replicate"))
            return inferred
        if stmt is None:
            return inferred
        name = stmt.rule.name.value
        if name not in ("cross_entropy", "vocab_parallel"):
            self.error(E0406, f"unknown loss `{name}`", stmt.rule.name.span, label="not a loss",
                       help="use `cross_entropy` or `vocab_parallel(AXIS)`")
            return inferred
        axes = self.check_axes(stmt.rule.axes, "the loss") if name == "vocab_parallel" else ()
        if axes is None:
            return inferred
        if name == "vocab_parallel" and inferred.axes != axes:
            got = "replicated (gathered)" if not inferred.sharded else f"sharded over {' x '.join(inferred.axes)}"
            self.error(E0404, f"the loss expects logits sharded over {' x '.join(axes) or 'nothing'} but they are {got}",
                       stmt.rule.span, label="loss layout", secondary=(Label(head.span, "logits placed here"),) if head and head.span else (),
                       help=f"shard `{last.name}` with `column({', '.join(axes)})`, or use `loss cross_entropy`",
                       suggestions=replace(stmt.rule.span, "cross_entropy", "Use `loss cross_entropy`"))
        if name == "cross_entropy" and inferred.sharded:
            self.error(E0404, f"`cross_entropy` needs full logits but `{last.name}` shards them over {' x '.join(inferred.axes)}",
                       stmt.rule.span, label="expects replicated logits",
                       help=f"use `loss vocab_parallel({', '.join(inferred.axes)})`: it never gathers the logits",
                       suggestions=replace(stmt.rule.span, f"vocab_parallel({', '.join(inferred.axes)})",
                                           f"Use `loss vocab_parallel({', '.join(inferred.axes)})`"))
        return inferred


def _tie_fixes(mine: Placement, theirs: Placement) -> tuple[Suggestion, ...]:
    """E0408's two ways out: split the tied pair alike (edit the one rule that differs), or
    replicate both (one suggestion editing both rules)."""
    if theirs.sharded:
        alike = make_rule(mine.span, f"column({', '.join(theirs.axes)})")
    else:
        alike = make_rule(theirs.span, f"vocab_parallel({', '.join(mine.axes)})")
    edits = tuple(e for p in (mine, theirs) if p.sharded for s in make_rule(p.span, "replicate") for e in s.edits)
    both = (Suggestion("Replicate both", edits),) if edits and all(p.span is not None for p in (mine, theirs) if p.sharded) else ()
    return alike + both


def _and_list(items: Iterable[str]) -> str:
    xs = list(items)
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]
