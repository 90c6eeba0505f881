"""The layout algebra a layer kind's record computes its activation flow with (meshllm_dsl/primitives
`flow`): what a linear layer makes of its input's layout (`through`), a sublayer's and a top-level
linear's whole flow, and what a flow must be where it rejoins the residual stream (`at_residual`).

The layouts and the Megatron pairing they follow are described in layouts.py, the plan-wide pass
that asks each unit's record for its flow; nothing here knows a layer kind, so the records import
this module and never the pass.
"""

from __future__ import annotations

from meshllm_dsl.codes import E0402, E0403
from meshllm_dsl.diagnostics import Label, Reporter, make_rule
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import REPLICATE, Collective, Placement, Unit, UnitFlow
from meshllm_dsl.parallel.collectives import spec
from meshllm_dsl.parallel.dtensor import Layout

R = Layout()  # the residual stream, and anything whole on every rank


def seq_layout(seq: tuple[str, ...]) -> Layout:
    """Sequence parallelism's residual stream: [b, s / t, hidden], Shard(seq) over `seq`."""
    return Layout.shard("seq", seq)


def rule_text(p: Placement) -> str:
    return f"{p.rule}({', '.join(p.axes)})" if p.sharded else "replicate"


def through(p: Placement, x: Layout, where: str, r: Reporter, collectives: list[Collective],
             source: tuple[str, Placement] | None = None, out: str = "hidden") -> Layout | None:
    """Layout after a linear with placement `p` whose input has layout `x`; None after an error.

    `out` names the feature a column layer's output holds (heads, ffn, vocab). `source` names the
    layer that produced a sharded input, so errors can point at its rule too.
    """
    def producer() -> tuple[Label, ...]:
        if source is None or source[1].span is None or source[1].span == p.span:
            return ()
        return (Label(source[1].span, f"`{source[0]}` shards its output here"),)

    split = x.feature_axes()  # the feature a column layer before this one sharded
    if not p.sharded:
        if split and p.span is None:
            return None  # placed by no rule at all: E0501 already names it; a layout error would be noise
        if split:
            r.error(E0402, f"`{where}` is replicated but its input is sharded over {' x '.join(split)}", p.span,
                    label="needs the full input", secondary=producer(),
                    help=f"make `{where}` `row({', '.join(split)})`: a column layer pairs with a row layer",
                    suggestions=make_rule(p.span, f"row({', '.join(split)})"))
            return None
        return R
    if p.rule == "column":
        if split:
            r.error(E0402, f"column layer `{where}` is fed an activation already sharded over {' x '.join(split)}",
                    p.span, label="column after column", secondary=producer(),
                    help=f"make `{where}` `row({', '.join(split)})`: a column layer must be followed by a row layer",
                    suggestions=make_rule(p.span, f"row({', '.join(split)})"))
            return None
        collectives.append(Collective("copy_to", p.axes, "input"))
        return Layout.shard(out, p.axes)
    # row
    if split:
        if split != p.axes:
            r.error(E0402, f"row layer `{where}` splits over {' x '.join(p.axes)} but its input is sharded over "
                    f"{' x '.join(split)}", p.span, label="axes differ", secondary=producer(),
                    help=f"use `row({', '.join(split)})` to match the column layer before it",
                    suggestions=make_rule(p.span, f"row({', '.join(split)})"))
            return None
    else:
        collectives.append(Collective("split_to", p.axes, "input"))
    return Layout.partial(p.axes)


def partial_error(x: Layout, what: str, span: Span | None, r: Reporter, producer: str) -> None:
    axes = x.partial_axes()
    r.error(E0403, f"a partial sum over {' x '.join(axes)} reaches {what}", span,
            label=f"`{producer}` is row-parallel here",
            help=f"make `{producer}` `column({', '.join(axes)})` so its output is sharded, not partial; "
            "row layers belong at the end of a sublayer, before the residual add",
            suggestions=make_rule(span, f"column({', '.join(axes)})"),
            note=f"{what} is not linear: applying it to each rank's partial sum and then adding is not the same as applying it to the sum")


class FlowSite:
    """One unit whose flow is asked for: its leaves' placements (keyed by leaf path), where it sits
    (`prefix`, for messages), whether it is the model's last unit, and where errors go. A kind's
    record (meshllm_dsl/primitives) computes its flow from it with the helpers below."""

    def __init__(self, unit: Unit, prefix: str, placement: dict[str, Placement], r: Reporter, last: bool) -> None:
        self.unit, self.prefix, self.placement, self.r, self.last = unit, prefix, placement, r, last

    def pl(self, leaf: str) -> Placement:
        return self.placement.get(f"{self.unit.name}.{leaf}" if leaf != self.unit.name else self.unit.name, REPLICATE)

    def name(self, leaf: str) -> str:
        u = self.unit.name
        return f"{self.prefix}{u}.{leaf}" if leaf != u else f"{self.prefix}{u}"


def sublayer_flow(site: FlowSite, nonlinear: str, combined: str, inner: str) -> UnitFlow | None:
    """A block sublayer's flow: column layers on the residual stream giving the feature `inner`
    (heads, ffn), combined by `combined` (e.g. attention) through a non-linearity (`nonlinear`), and a
    row layer closing it."""
    unit, r, pl, name, prefix = site.unit, site.r, site.pl, site.name, site.prefix
    collectives: list[Collective] = []
    inputs = [leaf.name for leaf in unit.leaves[:-1]]
    out_leaf = unit.leaves[-1].name
    layouts: dict[str, Layout] = {}
    for leaf in inputs:
        y = through(pl(leaf), R, name(leaf), r, collectives, out=inner)
        if y is None:
            return None
        layouts[leaf] = y
    for leaf, y in layouts.items():
        if y.partial_axes():
            partial_error(y, nonlinear, pl(leaf).span, r, name(leaf))
            return None
    first = inputs[0]
    for leaf in inputs[1:]:
        if layouts[leaf] != layouts[first]:
            a, b = layouts[first], layouts[leaf]
            r.error(E0402, f"{combined} combines `{name(first)}` ({a}) with `{name(leaf)}` ({b})",
                    pl(leaf).span or pl(first).span, label="layouts differ",
                    help=f"give {', '.join(f'`{name(x)}`' for x in inputs)} the same rule, e.g. "
                    f"`shard {prefix}{unit.name}.{{{','.join(inputs)}}} {rule_text(pl(first) if a.feature_axes() else pl(leaf))}`")
            return None
    # copy_to once for the whole unit: all input projections read the same normed activation
    seen: set[tuple[str, tuple[str, ...]]] = set()
    unique = []
    for c in collectives:
        if (c.op, c.axes) not in seen:
            seen.add((c.op, c.axes))
            unique.append(c)
    collectives = unique
    y = through(pl(out_leaf), layouts[first], name(out_leaf), r, collectives, (name(first), pl(first)))
    if y is None:
        return None
    inside = (*((leaf, layouts[leaf]) for leaf in inputs), (out_leaf, y))
    return at_residual(y, name(out_leaf), pl(out_leaf), collectives, r, inside)


def linear_flow(site: FlowSite) -> UnitFlow | None:
    """A top-level linear's flow: on the residual stream, or (the head) giving the logits."""
    collectives: list[Collective] = []
    p = site.pl(site.unit.name)
    y = through(p, R, site.name(site.unit.name), site.r, collectives, out="vocab" if site.last else "hidden")
    if y is None:
        return None
    if site.last:
        return UnitFlow(R, y, tuple(collectives))  # logits: the loss consumes them (checked there)
    return at_residual(y, site.name(site.unit.name), p, collectives, site.r, ((site.unit.name, y),))


def at_residual(y: Layout, where: str, p: Placement, collectives: list[Collective], r: Reporter,
                 inside: tuple[tuple[str, Layout], ...] = ()) -> UnitFlow | None:
    split = y.feature_axes()
    if split:
        r.error(E0402, f"`{where}` leaves its output sharded over {' x '.join(split)} at the residual add", p.span,
                label="the residual stream must be replicated",
                help=f"make `{where}` `row({', '.join(split)})` (its output is then summed), or `replicate`",
                suggestions=make_rule(p.span, f"row({', '.join(split)})") + make_rule(p.span, "replicate"))
        return None
    if y.partial_axes():
        collectives.append(Collective("reduce_from", y.partial_axes(), "output"))
    return UnitFlow(R, R, tuple(collectives), inside)


def under_seq(c: Collective, seq: tuple[str, ...]) -> Collective | None:
    """What sequence parallelism over `seq` turns `c` into (Megatron's f / g over the tensor axes
    become their sequence forms); None where it has none, or runs over other axes."""
    op = spec(c.op).under_seq
    return Collective(op, c.axes, c.where) if op is not None and c.axes == seq else None


