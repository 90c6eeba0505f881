"""Activation layouts across layer boundaries, per mesh axis in DTensor's terms (placements.py).

The residual stream is always Replicate. Inside a sublayer the layouts follow Megatron's pairing:
a column layer takes Replicate (the f operator `copy_to` in front) and gives Shard of its output
feature (heads, ffn, vocab) over its axes; a row layer takes that Shard and gives Partial, which the
g operator `reduce_from` sums at the residual add. Anything
else is a typed error at the boundary where it happens: a column layer fed a sharded activation,
a partial sum reaching a non-linearity, the attention core fed q / k / v laid out differently, a
sharded activation reaching the residual stream.

Under sequence parallelism over the tensor axes T (Megatron-LM, Korthikanti et al. 2022) the residual
stream and the norms are Shard(seq) over T instead: each tensor-parallel sublayer's f / g pair becomes
an all-gather along the sequence in front (reduce-scatter in backward) and a reduce-scatter after the
row layer (all-gather in backward), the vocab-parallel embedding's sum becomes a reduce-scatter, and
the head's input is all-gathered along the sequence. Every sublayer of the blocks must then be
tensor-parallel over exactly T (E0410).
"""

from __future__ import annotations

from typing import Protocol

from meshllm_dsl import primitives
from meshllm_dsl.codes import E0309, E0402, E0403, E0410
from meshllm_dsl.diagnostics import Label, make_rule
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import (
    REPLICATE,
    Collective,
    Leaf,
    ModelIR,
    Placement,
    PlanIR,
    Repeat,
    Tensor,
    Unit,
    UnitFlow,
)
from meshllm_dsl.parallel.collectives import spec
from meshllm_dsl.parallel.placements import Layout

R = Layout()  # the residual stream, and anything whole on every rank


def seq_layout(seq: tuple[str, ...]) -> Layout:
    """Sequence parallelism's residual stream: [b, s / t, hidden], Shard(seq) over `seq`."""
    return Layout.shard("seq", seq)


class _Reporter(Protocol):
    def error(self, code: str, message: str, span: Span | None, **kw: object) -> None: ...


def _rule_text(p: Placement) -> str:
    return f"{p.rule}({', '.join(p.axes)})" if p.sharded else "replicate"


def _through(p: Placement, x: Layout, where: str, r: _Reporter, collectives: list[Collective],
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


def _partial_error(x: Layout, what: str, span: Span | None, r: _Reporter, producer: str) -> None:
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

    def __init__(self, unit: Unit, prefix: str, placement: dict[str, Placement], r: _Reporter, last: bool) -> None:
        self.unit, self.prefix, self.placement, self.r, self.last = unit, prefix, placement, r, last

    def pl(self, leaf: str) -> Placement:
        return self.placement.get(f"{self.unit.name}.{leaf}" if leaf != self.unit.name else self.unit.name, REPLICATE)

    def name(self, leaf: str) -> str:
        u = self.unit.name
        return f"{self.prefix}{u}.{leaf}" if leaf != u else f"{self.prefix}{u}"


def unit_flow(unit: Unit, prefix: str, placement: dict[str, Placement], r: _Reporter, last: bool = False) -> UnitFlow | None:
    """The flow through one unit, given the placement of each of its leaves (keyed by leaf path)."""
    return primitives.of(unit).flow(FlowSite(unit, prefix, placement, r, last))


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
        y = _through(pl(leaf), R, name(leaf), r, collectives, out=inner)
        if y is None:
            return None
        layouts[leaf] = y
    for leaf, y in layouts.items():
        if y.partial_axes():
            _partial_error(y, nonlinear, pl(leaf).span, r, name(leaf))
            return None
    first = inputs[0]
    for leaf in inputs[1:]:
        if layouts[leaf] != layouts[first]:
            a, b = layouts[first], layouts[leaf]
            r.error(E0402, f"{combined} combines `{name(first)}` ({a}) with `{name(leaf)}` ({b})",
                    pl(leaf).span or pl(first).span, label="layouts differ",
                    help=f"give {', '.join(f'`{name(x)}`' for x in inputs)} the same rule, e.g. "
                    f"`shard {prefix}{unit.name}.{{{','.join(inputs)}}} {_rule_text(pl(first) if a.feature_axes() else pl(leaf))}`")
            return None
    # copy_to once for the whole unit: all input projections read the same normed activation
    seen: set[tuple[str, tuple[str, ...]]] = set()
    unique = []
    for c in collectives:
        if (c.op, c.axes) not in seen:
            seen.add((c.op, c.axes))
            unique.append(c)
    collectives = unique
    y = _through(pl(out_leaf), layouts[first], name(out_leaf), r, collectives, (name(first), pl(first)))
    if y is None:
        return None
    inside = (*((leaf, layouts[leaf]) for leaf in inputs), (out_leaf, y))
    return _at_residual(y, name(out_leaf), pl(out_leaf), collectives, r, inside)


def linear_flow(site: FlowSite) -> UnitFlow | None:
    """A top-level linear's flow: on the residual stream, or (the head) giving the logits."""
    collectives: list[Collective] = []
    p = site.pl(site.unit.name)
    y = _through(p, R, site.name(site.unit.name), site.r, collectives, out="vocab" if site.last else "hidden")
    if y is None:
        return None
    if site.last:
        return UnitFlow(R, y, tuple(collectives))  # logits: the loss consumes them (checked there)
    return _at_residual(y, site.name(site.unit.name), p, collectives, site.r, ((site.unit.name, y),))


def _at_residual(y: Layout, where: str, p: Placement, collectives: list[Collective], r: _Reporter,
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


def _seq_block_flow(unit: Unit, flow: UnitFlow, prefix: str, placement: dict[str, Placement],
                    seq: tuple[str, ...], seq_span: Span | None, r: _Reporter, quiet: bool = False) -> UnitFlow | None:
    """A block unit's flow under sequence parallelism over `seq`; None after an error (E0410)."""
    q = seq_layout(seq)
    if primitives.of(unit).norm:
        return UnitFlow(q, q, ())
    if not primitives.of(unit).sequence_parallel:
        r.error(E0309, f"sequence parallelism over {' x '.join(seq)} with the {unit.kind} layer `{prefix}{unit.name}` "
                "is not supported yet", seq_span, label="sequence parallelism asked for here",
                help=f"remove `seq -> {' * '.join(seq)}`; the {unit.kind} layer's tensor parallelism works without it")
        return None
    # Tensor-parallel over exactly `seq`: f in front of the column layers and g after the row layer
    # (inside, the column layers see the whole sequence again: the same layouts as without it).
    seq_ops = [under_seq(c, seq) for c in flow.collectives]
    if [c.where for c in flow.collectives] == ["input", "output"] and None not in seq_ops:
        return UnitFlow(q, q, tuple(c for c in seq_ops if c is not None), flow.inside)
    axes = " x ".join(seq)
    where = f"{prefix}{unit.name}"
    leaves = [lf.name for lf in unit.leaves]
    first = placement.get(f"{unit.name}.{leaves[0]}", REPLICATE)
    fix = (f"shard `{where}.{{{','.join(leaves[:-1])}}}` column({', '.join(seq)}) and `{where}.{leaves[-1]}` "
           f"row({', '.join(seq)}), or remove `seq -> {' * '.join(seq)}`")
    note = ("sequence parallelism shards the norms and the residual stream along the sequence between "
            "tensor-parallel sublayers: each sublayer gathers the sequence in front of its column layers "
            "and reduce-scatters it after its row layer")
    if first.sharded and first.span is not None:
        r.error(E0410, f"sequence parallelism over {axes} needs `{where}` tensor-parallel over {axes}", first.span,
                label=f"{first.rule}({', '.join(first.axes)}) here",
                secondary=(Label(seq_span, "sequence parallelism asked for here"),) if seq_span else (),
                help=fix, note=note)
    elif not quiet:  # (quiet: a sublayer before this one was refused already, at the same span)
        r.error(E0410, f"sequence parallelism over {axes} needs `{where}` tensor-parallel over {axes}", seq_span,
                label=f"`{where}` is replicated", help=fix, note=note)
    return None


def block_flows(rep: Repeat, placement: dict[str, Placement], r: _Reporter, prefix: str,
                seq: tuple[str, ...] = (), seq_span: Span | None = None) -> list[tuple[str, UnitFlow]]:
    out = []
    refused = False
    for unit in rep.body:
        flow = unit_flow(unit, prefix + ".", placement, r)
        if flow is not None and seq:
            flow = _seq_block_flow(unit, flow, prefix + ".", placement, seq, seq_span, r, refused)
            refused |= flow is None and primitives.of(unit).sublayer
        if flow is not None:
            out.append((unit.name, flow))
    return out


def top_flows(model: ModelIR, top: dict[str, Placement], loss: Placement,
              seq: tuple[str, ...] = ()) -> list[tuple[str, UnitFlow]]:
    class _Silent:
        def error(self, code: str, message: str, span: Span | None, **kw: object) -> None:
            pass  # top-level units are checked where their placements are chosen (loss, tied)

    out = []
    for i, item in enumerate(model.items):
        if isinstance(item, Unit):
            last = i == len(model.items) - 1
            flow = unit_flow(item, "", top, _Silent(), last=last)
            if flow is not None and seq:
                then = model.items[i + 1] if i + 1 < len(model.items) else None
                flow = primitives.of(item).seq_top_flow(item, flow, seq, last, then if isinstance(then, Unit) else None)
            if flow is not None:
                out.append((item.name, flow))
    return out


def seq_partial_grad(plan: PlanIR, unit: Unit, leaf: Leaf, t: Tensor) -> tuple[str, ...]:
    """Axes over which `t`'s gradient is a partial sum under sequence parallelism: norms, and a row
    layer's bias (added after the reduce-scatter), see only this rank's slice of the sequence."""
    if not plan.roles.sequence:
        return ()
    prim = primitives.of(unit)
    if prim.norm:
        return plan.roles.sequence
    if prim.sublayer and leaf is unit.leaves[-1] and len(t.shape) == 1:
        return plan.roles.sequence
    return ()


def column_partial_grad(p: Placement, t: Tensor) -> tuple[str, ...]:
    """Axes over which `t`'s gradient is a partial sum because `t` stays whole in a column layer split
    over them (a q / k norm scale shared by every head): each rank sees only its own heads' part."""
    if p.rule == "column" and p.sharded and p.tensor_dim(t) is None:
        return tuple(p.axes)
    return ()


def tied_head_with_own_bias(unit: Unit) -> bool:
    """A tied linear keeping a bias of its own (primitives/linear.py tied_with_own_bias)."""
    return primitives.of(unit) is primitives.linear.LINEAR and primitives.linear.tied_with_own_bias(unit)
