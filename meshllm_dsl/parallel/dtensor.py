"""Placements in DTensor's terms: what a tensor is on each mesh axis (Replicate, Shard(dim), Partial).

A `Layout` gives one placement per mesh axis (axes it does not name are Replicate), so one activation
can be Shard(seq) over one axis and Shard(hidden) over another. `Shard` names the logical dim it
splits ("seq", "heads", "vocab", ...) rather than an index: activations in this compiler are
[batch, seq, feature] (ACTIVATION_DIMS), parameters name their dims from their shard units, and
`dtensor_placements` turns either into the tuple torch.distributed.tensor would print, in mesh order.

No torch here: the compiler runs without it. The reprs match torch 2.13's (`Shard(dim=2)`,
`Replicate()`, `Partial(sum)`, `_StridedShard(dim=0, sf=2)`); tests/runtime/test_dtensor_placements.py
compares them with the DTensors torch builds for the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, assert_never

import attrs


@attrs.frozen
class Replicate:
    """Every rank of the axis holds the whole tensor."""

    def __str__(self) -> str:
        return "Replicate()"


@attrs.frozen
class Shard:
    """The axis splits the tensor along the logical dim `dim` (e.g. "seq", "heads", "vocab")."""

    dim: str

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@attrs.frozen
class Partial:
    """Each rank of the axis holds a summand: the tensor is the (pending) sum over the axis."""

    reduce_op: Literal["sum"] = "sum"

    def __str__(self) -> str:
        return f"Partial({self.reduce_op})"


AxisPlacement = Replicate | Shard | Partial

# An activation's dims: [batch, seq, feature], the feature named by what it holds (the residual
# stream's hidden, a column layer's heads / ffn, the logits' vocab).
FEATURE_DIMS = ("hidden", "heads", "ffn", "vocab")


def activation_dims(feature: str = "hidden") -> tuple[str, ...]:
    return ("batch", "seq", feature)


def _per_axis(value: Sequence[tuple[str, AxisPlacement]]) -> tuple[tuple[str, AxisPlacement], ...]:
    # Replicate is what an absent axis means: dropping it keeps one spelling per layout (equality).
    out = tuple((a, p) for a, p in value if not isinstance(p, Replicate))
    axes = [a for a, _ in out]
    if len(set(axes)) != len(axes):
        raise ValueError(f"a layout places axis {next(a for a in axes if axes.count(a) > 1)} twice")
    return out


@attrs.frozen
class Layout:
    """One placement per mesh axis. Axes it does not name are Replicate. Where several axes shard
    the same dim, their order here is the split order (the first outermost), as `mesh.index(*axes)`
    numbers shards at run time."""

    per_axis: tuple[tuple[str, AxisPlacement], ...] = attrs.field(default=(), converter=_per_axis)

    @staticmethod
    def shard(dim: str, axes: Sequence[str]) -> Layout:
        return Layout(tuple((a, Shard(dim)) for a in axes))

    @staticmethod
    def partial(axes: Sequence[str]) -> Layout:
        return Layout(tuple((a, Partial()) for a in axes))

    def on(self, axis: str) -> AxisPlacement:
        return dict(self.per_axis).get(axis, Replicate())

    def then(self, other: Layout) -> Layout:
        """This layout with `other`'s placements added on axes this one leaves Replicate (after it in
        the split order); an axis both place is a compiler bug."""
        return Layout(self.per_axis + other.per_axis)

    @property
    def replicated(self) -> bool:
        return not self.per_axis

    def sharded_axes(self, *, besides: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The axes that shard a dim (any but those in `besides`), in split order."""
        return tuple(a for a, p in self.per_axis if isinstance(p, Shard) and p.dim not in besides)

    def feature_axes(self) -> tuple[str, ...]:
        """The axes that shard the feature dim (a column layer's output), not batch or seq."""
        return self.sharded_axes(besides=("batch", "seq"))

    def partial_axes(self) -> tuple[str, ...]:
        return tuple(a for a, p in self.per_axis if isinstance(p, Partial))

    def feature(self) -> str:
        """The name of the activation's last dim as far as this layout knows it (hidden unless a
        placement shards another feature)."""
        return next((p.dim for _, p in self.per_axis if isinstance(p, Shard) and p.dim in FEATURE_DIMS), "hidden")

    def __str__(self) -> str:
        """`Replicate()`, or each placement with its axes: `Shard(seq) over cp, Shard(heads) over tensor`."""
        if not self.per_axis:
            return "Replicate()"
        groups: list[tuple[AxisPlacement, list[str]]] = []
        for axis, p in self.per_axis:
            if groups and groups[-1][0] == p:
                groups[-1][1].append(axis)
            else:
                groups.append((p, [axis]))
        return ", ".join(f"{p} over {' x '.join(axes)}" for p, axes in groups)


def dtensor_repr(p: AxisPlacement, dims: Sequence[str], split_factor: int = 1) -> str:
    """`p` as torch.distributed.tensor's repr prints it, for a tensor whose dims are `dims`."""
    match p:
        case Replicate():
            return "Replicate()"
        case Partial(reduce_op=op):
            return f"Partial({op})"
        case Shard(dim=d):
            if d not in dims:
                raise ValueError(f"Shard({d}) of a tensor whose dims are {', '.join(dims)}")
            i = list(dims).index(d)
            return f"_StridedShard(dim={i}, sf={split_factor})" if split_factor > 1 else f"Shard(dim={i})"
        case _:
            assert_never(p)


def dtensor_placements(layout: Layout, mesh: Sequence[tuple[str, int]], dims: Sequence[str]) -> tuple[str, ...]:
    """The placements torch would give a DTensor laid out as `layout` over `mesh` ((axis, size) in
    mesh order), as it prints them.

    torch nests the shards of one dim in mesh order (left axis outermost). Where the split order
    differs, as when FSDP2 shards a tensor-parallel shard again (the mesh's data axis left of its
    tensor axis, the data split inside the tensor one), the inner axis is torch's `_StridedShard`
    with split factor the sizes of the outer axes right of it (fsdp/_fully_shard/_fsdp_param.py)."""
    order = [a for a, _ in layout.per_axis]
    out = []
    for i, (axis, _) in enumerate(mesh):
        p = layout.on(axis)
        sf = 1
        if isinstance(p, Shard):
            sf = math.prod(size for b, size in mesh[i + 1:]
                           if layout.on(b) == p and order.index(b) < order.index(axis))
        out.append(dtensor_repr(p, dims, sf))
    return tuple(out)


def dtensor_text(placements: Sequence[str]) -> str:
    """`placements=(Replicate(), Shard(dim=2))`, as a DTensor's repr shows them."""
    return f"placements=({', '.join(placements)}{',' if len(placements) == 1 else ''})"
