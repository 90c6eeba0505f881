"""Activation layouts across layer boundaries, per mesh axis in DTensor's terms (dtensor.py).

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

This module is the plan-wide pass: it asks each unit's record (meshllm_dsl/primitives) for its flow
and applies sequence parallelism to the blocks. The algebra the records compute a flow with is
flow.py's, below them.
"""

from __future__ import annotations

from meshllm_dsl import primitives
from meshllm_dsl.codes import E0309, E0410
from meshllm_dsl.diagnostics import Label, Reporter
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import (
    REPLICATE,
    Leaf,
    ModelIR,
    Placement,
    PlanIR,
    Repeat,
    Tensor,
    Unit,
    UnitFlow,
)
from meshllm_dsl.parallel.flow import FlowSite, seq_layout, under_seq


def unit_flow(unit: Unit, prefix: str, placement: dict[str, Placement], r: Reporter, last: bool = False) -> UnitFlow | None:
    """The flow through one unit, given the placement of each of its leaves (keyed by leaf path)."""
    return primitives.of(unit).flow(FlowSite(unit, prefix, placement, r, last))


def _seq_block_flow(unit: Unit, flow: UnitFlow, prefix: str, placement: dict[str, Placement],
                    seq: tuple[str, ...], seq_span: Span | None, r: Reporter, quiet: bool = False) -> UnitFlow | None:
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


def block_flows(rep: Repeat, placement: dict[str, Placement], r: Reporter, prefix: str,
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
