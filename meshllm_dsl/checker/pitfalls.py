"""Pitfalls of a valid plan: roles of mesh axes (E0407, W0702, W0704) and splits that split nothing,
split too fine or cross hosts (W0705-W0707)."""

from __future__ import annotations

from meshllm_dsl.checker.context import (
    PlanContext,
    _blocks_text,
)
from meshllm_dsl.codes import E0407, W0702, W0704, W0705, W0706, W0707
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import BlockClass, Leaf, Placement, Repeat


class PitfallRules(PlanContext):
    def sharding_warnings(self, top: dict[str, Placement], classes: tuple[BlockClass, ...]) -> None:
        """Pitfalls of a valid plan: a split that splits nothing (W0705), splits too fine (W0706), or a
        sharding group larger than a host when the mesh does not say how many hosts (W0707)."""
        placed: list[tuple[str, Leaf | None, Placement]] = [(k, self._top_leaf(k), p) for k, p in top.items()]
        counts = {r.name: r.count for r in self.model.repeats}
        for c in classes:
            which = "*" if len(c.indices) == counts[c.repeat] else _blocks_text(c.indices)
            placed += [(f"{c.repeat}.{which}.{path}", self._block_leaf(c.repeat, path), p) for path, p in c.placements]
        warned: set[tuple[str, object]] = set()
        for path, leaf, p in placed:
            if leaf is None or not p.sharded or not leaf.params:
                continue
            n = self.mesh.size(*p.axes)
            axes = " x ".join(p.axes)
            where = p.span.start if p.span is not None else None
            if n == 1:
                if (W0705, p.axes) not in warned:
                    warned.add((W0705, p.axes))
                    self.warn(W0705, f"`{path}` is split over {axes}, of size 1", p.span,
                              label="splits nothing", secondary=tuple(lab for a in p.axes for lab in self.axis_label(a)),
                              help="use `replicate`, or give the axis a size above 1")
                continue
            w = leaf.params[0]
            full = w.shape[1] if p.rule == "row" and len(w.shape) > 1 else w.shape[0]
            if full >= 1024 and full // n < 128 and (W0706, where) not in warned:
                warned.add((W0706, where))
                self.warn(W0706, f"`{path}` keeps {full // n} of {full} columns per device over {axes} ({n})", p.span,
                          label="over-sharded", secondary=tuple(lab for a in p.axes for lab in self.axis_label(a)),
                          help=f"use {axes} of at most {max(1, full // 128)} and give the devices to data parallelism "
                          "(`meshc plan` shows the communication time)")
            if (self.per_host is not None and self.mesh.hosts == 1 and n > self.per_host
                    and (W0707, p.axes) not in warned):
                warned.add((W0707, p.axes))
                self.warn(W0707, f"`{path}` is split over {n} devices, more than the {self.per_host} of one "
                          f"`{self.mesh.device or 'h100'}` host", p.span, label="collectives cross hosts",
                          secondary=tuple(lab for a in p.axes for lab in self.axis_label(a)),
                          help=f"declare `hosts` on mesh `{self.mesh.name}` and keep this axis within {self.per_host} devices")

    def _top_leaf(self, path: str) -> Leaf | None:
        return next((leaf for item, _, leaf in self.model.leaves() if not isinstance(item, Repeat)
                     and ".".join(leaf.path) == path), None)

    def _block_leaf(self, repeat: str, path: str) -> Leaf | None:
        return next((leaf for item, _, leaf in self.model.leaves() if isinstance(item, Repeat)
                     and item.name == repeat and ".".join(leaf.path) == path), None)

    def axis_usage(self, top: dict[str, Placement], classes: tuple[BlockClass, ...], pipeline_axis: str | None,
                   batch_axes: tuple[str, ...], context_axes: tuple[str, ...] = ()) -> None:
        shard_axes: dict[str, Span | None] = {}
        for p in [*top.values(), *(pl for c in classes for _, pl in c.placements)]:
            for a in p.axes:
                shard_axes.setdefault(a, p.span)
        roles: dict[str, str] = {}
        if pipeline_axis:
            roles[pipeline_axis] = "the pipeline"
        for a in batch_axes:
            if a in roles:
                self.error(E0407, f"axis `{a}` is both {roles[a]} and a batch axis", self.decl.name.span,
                           label=f"plan `{self.decl.name.value}`", help="give each mesh axis one role")
            roles.setdefault(a, "a batch axis")
        for a in context_axes:  # (a context axis that is also the pipeline or a batch axis: E0411)
            roles.setdefault(a, "the context-parallel axis")
        for a, span in shard_axes.items():
            if a in roles:
                self.error(E0407, f"axis `{a}` is {roles[a]}; parameters cannot also be sharded over it", span,
                           label=f"shards over `{a}`",
                           help="shard parameters over a separate tensor axis; to save memory on the data axis shard the optimizer states: `optimizer adamw { zero 1 }`")
            if self.mesh.hosts > 1 and self.mesh.crosses_hosts(a):
                self.warn(W0702, f"tensor-parallel axis `{a}` spans hosts", span, label="collectives cross the network every layer",
                          secondary=self.axis_label(a),
                          help="put the tensor axis last in `axes` (last varies fastest) and keep its size within devices per host "
                          f"({self.mesh.devices_per_host})")
        used = set(shard_axes) | set(roles)
        # An axis looks unused when the rule or stage map using it was rejected: warn only on clean plans.
        for a in (self.mesh.axes if not self.failed else ()):
            if a.name not in used and a.size > 1:
                self.warn(W0704, f"mesh axis `{a.name}` is not used by plan `{self.decl.name.value}`", self.decl.name.span,
                          label="every rank along it does identical work", secondary=self.axis_label(a.name),
                          help=f"use it: `layout {{ batch -> {a.name} }}` for data parallelism, a `shard` rule, or `stages over {a.name}`")
