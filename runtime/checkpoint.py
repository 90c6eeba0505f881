"""Sharded checkpoints with ``torch.distributed.checkpoint`` that load into any other layout.

Each parameter is saved under its full name as a DTensor over the mesh axes it is sharded on
(plain tensors when replicated), so DCP records which slice of the full tensor every shard holds
and can reshard on load.  Copies on several ranks (data replicas, tied weights) are written once.
Fused tensors with segments (qkv) are saved one segment per key, ``NAME@j``: a segment-wise
chunking is not a single DTensor placement.  Only model weights are saved, not optimizer state.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .mesh import Mesh
from .program import Built
from .shards import ShardSpec

__all__ = ["load", "save"]


def _device_mesh(mesh: Mesh, spec: ShardSpec, device_type: str) -> DeviceMesh:
    """A DeviceMesh over the sharded axes of ``spec`` (one mesh dim per sharded tensor dim).

    Built from the groups ``Mesh`` already has (``from_group`` creates none), which also works in
    the worker pool where the mesh is smaller than the world.
    """
    axes_per_dim = [axes for _, axes in _split_dims(mesh, spec)]
    groups = [mesh.group(*axes) for axes in axes_per_dim]
    sizes = [mesh.size(*axes) for axes in axes_per_dim]
    ranks = torch.empty(sizes, dtype=torch.long)
    for idx in (
        torch.cartesian_prod(*[torch.arange(s) for s in sizes]).reshape(-1, len(sizes)).tolist()
    ):
        at: dict[str, int] = {}
        for axes, flat in zip(axes_per_dim, idx):
            for a in reversed(axes):  # unflatten row-major
                at[a], flat = flat % mesh.size(a), flat // mesh.size(a)
        ranks[tuple(idx)] = mesh.rank_at(**at)
    names = tuple("x".join(axes) for axes in axes_per_dim)
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device_type, ranks, mesh_dim_names=names)  # type: ignore[arg-type]
    return DeviceMesh.from_group(groups, device_type, ranks, mesh_dim_names=names)  # type: ignore[arg-type]


def _split_dims(mesh: Mesh, spec: ShardSpec) -> list[tuple[int, tuple[str, ...]]]:
    """The dims of ``spec`` that are really split on this mesh (axes of size 1 split nothing)."""
    return [(dim, axes) for dim, axes in spec.dims if mesh.size(*axes) > 1]


def _entries(built: Built) -> dict[str, tuple[Tensor, ShardSpec, int | None]]:
    """Checkpoint key -> (this rank's local tensor (a view of the parameter), spec, segment)."""
    out: dict[str, tuple[Tensor, ShardSpec, int | None]] = {}
    for i in built.stage_ids:
        for name, spec in built.specs[i].items():
            param = built.modules[i].get_parameter(spec.local).detach()
            if spec.segments is None:
                out.setdefault(name, (param, spec, None))
                continue
            n = built.mesh.size(*spec.dims[0][1])
            parts = param.split([s // n for s in spec.segments], dim=spec.dims[0][0])
            for j, part in enumerate(parts):
                out.setdefault(f"{name}@{j}", (part, spec, j))
    return out


def _state(
    built: Built, entries: dict[str, tuple[Tensor, ShardSpec, int | None]]
) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for key, (local, spec, seg) in entries.items():
        local = local.clone()
        dims = _split_dims(built.mesh, spec)
        if not dims:
            state[key] = local
            continue
        shape = list(spec.shape)
        if seg is not None:
            assert spec.segments is not None
            shape[spec.dims[0][0]] = spec.segments[seg]
        stride = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
        placements = [Shard(dim) for dim, _ in dims]
        mesh = _device_mesh(built.mesh, spec, built.device.type)
        state[key] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride)
        )
    return state


def _dist_kwargs(mesh: Mesh) -> dict[str, object]:
    # A one-rank mesh has no group; DCP's default would be the whole world (hang in the pool).
    group = mesh.group(*mesh.names)
    return {"no_dist": True} if group is None else {"process_group": group}


def save(built: Built, path: str | Path) -> None:
    """Write the weights of every rank of ``built`` to the directory ``path`` (collective)."""
    state = _state(built, _entries(built))
    dcp.save(state, checkpoint_id=str(path), **_dist_kwargs(built.mesh))


@torch.no_grad()
def load(built: Built, path: str | Path) -> None:
    """Load weights saved by ``save`` from any layout into ``built`` (collective)."""
    entries = _entries(built)
    state = _state(built, entries)
    dcp.load(state, checkpoint_id=str(path), **_dist_kwargs(built.mesh))
    for key, (local, _, _) in entries.items():
        value = state[key]
        local.copy_(value.to_local() if isinstance(value, DTensor) else value)
    # Tied copies beyond the first holder on this rank, and the parameters behind the views.
    for i in built.stage_ids:
        for name, spec in built.specs[i].items():
            param = built.modules[i].get_parameter(spec.local)
            first = entries[name if spec.segments is None else f"{name}@0"][0]
            if spec.segments is None and first.data_ptr() != param.data_ptr():
                param.copy_(first)
