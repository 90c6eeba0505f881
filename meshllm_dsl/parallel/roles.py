"""Which mesh axes play which parallel role in a plan: one record, validated once.

As torchtitan's `ParallelDims`: a plan's pipeline, batch (replicated or ZeRO-sharded), tensor,
sequence and loss axes live together, and the rules between them (an axis has one role, ZeRO shards
over batch axes, sequence parallelism runs over tensor axes) are checked where the record is built.

The checker reports a spec's conflicts as located diagnostics before it builds a plan, so a
`ValueError` from here is a compiler bug (or a test building a bad record), never a user's error.
Context parallelism runs over axes that split no weight; expert parallelism over batch, context and tensor axes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import attrs


class NamedMesh(Protocol):
    """What `validate` reads of a mesh (ir.MeshIR, which holds a plan's roles beside its mesh and so
    sits above this module): its name and its axes by name."""

    @property
    def name(self) -> str: ...

    def axis(self, name: str) -> object | None: ...


def _axes(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class ParallelRoles:
    pipeline: str | None = None  # the axis the stages are spread over (`stages over P`)
    batch: tuple[str, ...] = attrs.field(default=(), converter=_axes)  # `layout { batch -> D }`: data parallelism
    # The batch axes ZeRO (stage >= 1) shards optimizer states (and gradients, parameters) over; the
    # other batch axes hold replicas. Empty without ZeRO.
    batch_shard: tuple[str, ...] = attrs.field(default=(), converter=_axes)
    tensor: tuple[str, ...] = attrs.field(default=(), converter=_axes)  # axes some parameter is split over
    sequence: tuple[str, ...] = attrs.field(default=(), converter=_axes)  # Megatron SP (`layout { seq -> T }`)
    loss: tuple[str, ...] = attrs.field(default=(), converter=_axes)  # vocab-parallel cross entropy over these
    # `layout { seq -> C }` over axes that split no weight: every sequence split over them (runtime/parallel/context.py)
    context: tuple[str, ...] = attrs.field(default=(), converter=_axes)
    # `layout { experts -> D }`: the batch, context and tensor axes moe layers split their experts over (tokens travel by all-to-all)
    expert: tuple[str, ...] = attrs.field(default=(), converter=_axes)

    def __attrs_post_init__(self) -> None:
        for role in ("batch", "batch_shard", "tensor", "sequence", "loss", "context", "expert"):
            axes = getattr(self, role)
            twice = sorted({a for a in axes if axes.count(a) > 1})
            if twice:
                raise ValueError(f"{role} axes name {', '.join(twice)} twice")
        if self.pipeline is not None:
            for role in ("batch", "tensor", "context"):
                if self.pipeline in getattr(self, role):
                    raise ValueError(f"axis `{self.pipeline}` is both the pipeline and a {role} axis")
        for one, other in (("batch", "tensor"), ("context", "tensor"), ("context", "batch")):
            shared = sorted(set(getattr(self, one)) & set(getattr(self, other)))
            if shared:
                raise ValueError(f"axes {', '.join(shared)} are both {one} and {other} axes")
        for role, within, what in (("batch_shard", "replicas", "batch or context"), ("sequence", "tensor", "tensor"),
                                   ("loss", "tensor", "tensor"), ("expert", "token_axes", "batch, context or tensor")):
            outside = [a for a in getattr(self, role) if a not in getattr(self, within)]
            if outside:
                raise ValueError(f"{role} axes {', '.join(outside)} are not {what} axes")
        if set(self.expert) & set(self.sequence):
            raise ValueError(f"expert axes {', '.join(sorted(set(self.expert) & set(self.sequence)))} are sequence-parallel")

    def validate(self, mesh: NamedMesh) -> None:
        """Every axis a role names is an axis of `mesh`."""
        for role, axes in self.named():
            missing = [a for a in axes if mesh.axis(a) is None]
            if missing:
                raise ValueError(f"{role} axes {', '.join(missing)} are not axes of mesh `{mesh.name}`")

    def named(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(role, axes) for every role, the pipeline as a 0- or 1-axis tuple."""
        return (("pipeline", (self.pipeline,) if self.pipeline else ()), ("batch", self.batch),
                ("batch_shard", self.batch_shard), ("tensor", self.tensor), ("sequence", self.sequence),
                ("loss", self.loss), ("context", self.context), ("expert", self.expert))

    @property
    def replicas(self) -> tuple[str, ...]:
        """The axes the parameters are replicated over and their gradients averaged over: batch, then context."""
        return (*self.batch, *self.context)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes the experts may split over: batch and context (tokens differ along them) and tensor."""
        return (*self.replicas, *self.tensor)

    @property
    def expert_token_split(self) -> tuple[str, ...]:
        """The expert axes along which every rank holds the same tokens (tensor axes): each rank of
        them routes 1 / |axes| of the tokens to the experts and all-gathers the outputs back."""
        return tuple(a for a in self.expert if a in self.tensor)

    @property
    def batch_replicate(self) -> tuple[str, ...]:
        """The batch (and context) axes that hold full replicas of the (optimizer) state: those ZeRO does not shard."""
        return tuple(a for a in self.replicas if a not in self.batch_shard)

    @property
    def context_parallel(self) -> bool:
        return bool(self.context)

    @property
    def zero_enabled(self) -> bool:
        return bool(self.batch_shard)

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.sequence)

    @property
    def loss_parallel(self) -> bool:
        return bool(self.loss)
