"""Deterministic full-size initialisation and the mapping between full tensors and local shards."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshllm_dsl.runtime.parallel.mesh import Mesh

__all__ = ["ShardSpec", "full_init", "gather_full", "gather_module", "load_full", "local_slice"]


@dataclass(frozen=True)
class ShardSpec:
    """Where one full parameter lives on a rank.

    ``local``: attribute path of the local parameter inside the stage module.
    ``shape``: the full (global) shape.
    ``dims``: (tensor dim, mesh axes) pairs that are sharded, outermost first; empty = replicated.
    ``segments``: sizes along the first sharded dim of independently chunked parts of a fused
    tensor (e.g. qkv rows [q | k | v]): each part is split over the axes separately and a rank's
    shard is the concatenation of its chunk of every part.
    ``partial_grad``: mesh axes over which each rank's gradient is only a partial sum, though the
    parameter is replicated over them: under sequence parallelism a norm (or a row layer's bias)
    sees only its rank's slice of the sequence.  The runtime sums these gradients over the axes
    after backward (Megatron's ``allreduce_sequence_parallel_grad``).
    """

    local: str
    shape: tuple[int, ...]
    dims: tuple[tuple[int, tuple[str, ...]], ...] = ()
    segments: tuple[int, ...] | None = field(default=None)
    partial_grad: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.segments is not None and (
            not self.dims or sum(self.segments) != self.shape[self.dims[0][0]]
        ):
            raise ValueError(f"segments {self.segments} do not cover the sharded dim of {self}")

    def local_shape(self, mesh: Mesh) -> tuple[int, ...]:
        shape = list(self.shape)
        for dim, axes in self.dims:
            shape[dim] //= mesh.size(*axes)
        return tuple(shape)


def _seed_for(name: str, seed: int) -> int:
    # A stable hash (not Python's salted hash()) so every process and every run agree.
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def full_init(
    name: str, shape: Sequence[int], seed: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Initial value of the full parameter ``name``; depends only on (name, shape, seed).

    Biases are zeros, other 1-D weights (norm scales) ones, matrices normal(0, 0.02).  Values are
    drawn in float32 and then cast, so every dtype starts from the same numbers.
    """
    shape = tuple(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(_seed_for(name, seed))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype)


def _parts(t: Tensor, dim: int, segments: tuple[int, ...] | None) -> list[Tensor]:
    return list(t.split(list(segments), dim=dim)) if segments else [t]


def local_slice(full: Tensor, spec: ShardSpec, mesh: Mesh) -> Tensor:
    """This rank's shard of ``full`` (a contiguous copy)."""
    if tuple(full.shape) != spec.shape:
        raise ValueError(
            f"{spec.local}: full tensor has shape {tuple(full.shape)}, expected {spec.shape}"
        )
    out = full
    for k, (dim, axes) in enumerate(spec.dims):
        n, i = mesh.size(*axes), mesh.index(*axes)
        segments = spec.segments if k == 0 else None
        out = torch.cat([p.chunk(n, dim=dim)[i] for p in _parts(out, dim, segments)], dim=dim)
    return out.contiguous().clone()


def gather_full(local: Tensor, spec: ShardSpec, mesh: Mesh) -> Tensor:
    """Inverse of ``local_slice``: all-gather the shards over their axes (every member gets it)."""
    out = local.detach().contiguous()
    for k in reversed(range(len(spec.dims))):
        dim, axes = spec.dims[k]
        group = mesh.group(*axes)
        if group is None:
            continue
        n = mesh.size(*axes)
        shards = [torch.empty_like(out) for _ in range(n)]
        # [.., full / n, ..] per rank -> n shards of this dim, in group-rank == index order.
        dist.all_gather(shards, out, group=group)
        segments = spec.segments if k == 0 else None
        if segments:
            # Each shard is [seg0 chunk | seg1 chunk | ...]; regroup chunks by segment.
            sizes = [s // n for s in segments]
            pieces = [list(s.split(sizes, dim=dim)) for s in shards]
            out = torch.cat([pieces[r][j] for j in range(len(sizes)) for r in range(n)], dim=dim)
        else:
            out = torch.cat(shards, dim=dim)
    return out


def load_full(
    module: nn.Module, specs: Mapping[str, ShardSpec], mesh: Mesh, full: Mapping[str, Tensor]
) -> None:
    """Copy this rank's shard of every full tensor named in ``specs`` into ``module``."""
    with torch.no_grad():
        for name, spec in specs.items():
            if name not in full:
                raise KeyError(f"full state dict has no {name!r}")
            param = module.get_parameter(spec.local)
            param.copy_(local_slice(full[name].to(param.dtype), spec, mesh))


def gather_module(
    module: nn.Module, specs: Mapping[str, ShardSpec], mesh: Mesh, grads: bool = False
) -> dict[str, Tensor]:
    """Full-shape parameters (or gradients; zeros where none) of ``module`` keyed by full name.

    Collective over the sharded axes: every rank holding ``module`` must call it.
    """
    out: dict[str, Tensor] = {}
    for name, spec in specs.items():
        param = module.get_parameter(spec.local)
        local = (
            param
            if not grads
            else (param.grad if param.grad is not None else torch.zeros_like(param))
        )
        out[name] = gather_full(local, spec, mesh)
    return out
