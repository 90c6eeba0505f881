"""ZeRO-2 / ZeRO-3 (also hybrid-sharded, HSDP), ZeRO-1 with sharded master weights (Megatron's
distributed optimizer) and mixed precision with master weights, by PyTorch's FSDP2 (``fully_shard``).

A stage holds plain local tensors (its tensor-parallel shards, laid out by ``ShardSpec``); FSDP2
shards each of them again along dim 0 over the data-parallel ranks, as torchtitan composes FSDP2
with tensor parallelism: every block of the repeat is one unit (all-gathered before its forward,
resharded after it with ZeRO-3, kept gathered until backward with ZeRO-2 and ZeRO-1), then the
stage root holds the rest. Gradients are reduce-scattered and averaged over the data ranks by FSDP2 itself,
so the hand-written data all-reduce skips these parameters.

Parameters become DTensors over a 1-D data mesh whose local part is this rank's ``torch.chunk`` of
the tensor-parallel shard. The helpers below turn them back into that shard (``tp_local``) and
store one into them (``store_tp_local``), so checkpoints, verification and export keep working on
the tensor-parallel layout they already know.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from meshllm_dsl.runtime.parallel.mesh import Mesh

__all__ = [
    "data_local", "data_mesh", "defers_grad_sync", "is_sharded", "like_sharded", "shard_stage", "store_tp_local",
    "tp_local", "uses_fsdp",
]


def uses_fsdp(zero: int, param_dtype: torch.dtype | None) -> bool:
    """Whether a plan's parameters are FSDP2's: ZeRO 2 / 3, and ZeRO 1 with `precision` (Megatron's
    distributed optimizer: the fp32 master weights are sharded with the moments, so they cannot be
    the module's whole parameters as ZeroRedundancyOptimizer would keep them)."""
    return zero >= 2 or (zero == 1 and param_dtype is not None)


def defers_grad_sync(zero: int, param_dtype: torch.dtype | None) -> bool:
    """ZeRO 1 with master weights reduces gradients once a step, as Megatron's distributed optimizer
    does: between a step's microbatches FSDP2 keeps every unit gathered in the compute dtype and
    accumulates its whole gradient in the reduce dtype (Megatron's fp32 grad buffer), and only the
    last backward reduce-scatters. ZeRO 2 reduce-scatters every microbatch's gradients."""
    return zero == 1 and param_dtype is not None


def _axis_group(mesh: Mesh, axes: tuple[str, ...]) -> tuple[Any, list[int]]:
    """The group over ``axes`` holding this rank and its ranks; a group of this rank alone when
    ``axes`` is empty or spans one rank (``Mesh.group`` gives None there)."""
    group = mesh.group(*axes) if axes else None
    if group is None:
        singles = mesh.make_groups([(r,) for r in mesh.ranks])
        return singles[(mesh.rank,)], [mesh.rank]
    return group, list(mesh.ranks_along(*axes))


def data_mesh(
    mesh: Mesh, batch_axes: tuple[str, ...], device_type: str, shard_axes: tuple[str, ...] | None = None
) -> Any:
    """The DeviceMesh FSDP2 shards over: 1-D over the batch axes flattened, or with HSDP
    (``shard_axes`` a strict subset of ``batch_axes``) 2-D ``(replicate, shard)``, torchtitan's
    ``dp_replicate x dp_shard``: parameters sharded over the shard axes and replicated over the
    rest, gradients reduce-scattered within a shard group and then all-reduced across replicas.

    Built from the group ``Mesh`` already made (``from_group`` creates none), which also works in
    the worker pool whose mesh is smaller than the world. With one data rank (no batch axes, or
    axes of size 1) it is a group of this rank alone, so mixed precision still applies.
    """
    from torch.distributed.device_mesh import DeviceMesh

    order = mesh.names  # Mesh.group wants its axes in mesh order
    shard = tuple(a for a in order if a in (batch_axes if shard_axes is None else shard_axes))
    replicate = tuple(a for a in order if a in batch_axes and a not in shard)
    if not replicate or mesh.size(*replicate) == 1:
        group, ranks = _axis_group(mesh, shard)
        name = "x".join(shard) or "data"
        return DeviceMesh.from_group(group, device_type, torch.tensor(ranks), mesh_dim_names=(name,))
    (rgroup, _), (sgroup, _) = _axis_group(mesh, replicate), _axis_group(mesh, shard)
    # [replicate, shard]: the global rank at each pair of flattened coordinates.
    layout = [[_rank_at(mesh, replicate, r, shard, s) for s in range(mesh.size(*shard))]
              for r in range(mesh.size(*replicate))]
    return DeviceMesh.from_group([rgroup, sgroup], device_type, torch.tensor(layout),
                                 mesh_dim_names=("x".join(replicate), "x".join(shard)))


def _rank_at(mesh: Mesh, replicate: tuple[str, ...], r: int, shard: tuple[str, ...], s: int) -> int:
    """The global rank at flattened coordinate ``r`` over ``replicate`` and ``s`` over ``shard``
    (the other axes at this rank's coordinates)."""
    coords: dict[str, int] = {}
    for axes, flat in ((replicate, r), (shard, s)):
        for a in reversed(axes):
            coords[a], flat = flat % mesh.size(a), flat // mesh.size(a)
    return mesh.rank_at(**coords)


def shard_stage(
    module: nn.Module,
    dmesh: Any,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    experts: set[str] = frozenset(),  # type: ignore[assignment]
    cast_stage_inputs: bool = True,
    expert_units: Mapping[str, tuple[Any, float]] | None = None,
) -> None:
    """``fully_shard`` every block of ``module`` and then ``module`` itself, in place.

    ``experts``: local names of the parameters of experts split over batch axes (expert
    parallelism), left out of the dense units. ``expert_units``: the layers whose experts other
    ZeRO ranks also hold (module name -> (their 1-D mesh, the gradient divisor)), each made its own
    unit over that mesh (torchtitan's dp_mod_ep sharding); the other experts stay plain tensors,
    nothing to shard (no other ZeRO rank holds them).
    ``cast_stage_inputs=False``: the stage root leaves its inputs' dtypes alone (its forward casts
    the activations itself), so fp32 inputs beside them stay fp32: the routing statistics a
    pipeline stage receives (runtime/train/program.py). The blocks still cast what they get."""
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    # Compute in param_dtype, reduce gradients in reduce_dtype; the parameters FSDP2 keeps (and
    # the optimizer steps) stay in the dtype the module was built in: the master weights.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    root_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                   cast_forward_inputs=cast_stage_inputs)
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, (nn.ModuleDict, nn.ModuleList)):
        for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
            fully_shard(block, mesh=dmesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                        ignored_params=_named(module, block, experts))
    fully_shard(module, mesh=dmesh, reshard_after_forward=reshard_after_forward, mp_policy=root_mp,
                ignored_params=_named(module, module, experts))
    # After the dense units, which leave these experts out: a unit nested in one takes only the
    # parameters it does not ignore (the layer's router and shared expert stay the block's).
    for name, (emesh, divide) in (expert_units or {}).items():
        unit = module.get_submodule(name)
        dense = {q for q in unit.parameters()} - (_named(module, unit, experts) or set())
        fully_shard(unit, mesh=emesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    ignored_params=dense or None)
        # The generated forward calls `experts`, not `forward` (runtime/moe/dispatch.py).
        register_fsdp_forward_method(unit, "experts")
        # Each rank's expert gradients already hold the tokens of every rank of the expert axes
        # (the all-to-all's backward); the mean over all batch ranks the reference takes is their
        # sum over this mesh divided by all of them, not by this mesh's size. Summed, then
        # divided: gloo has no PREMUL_SUM.
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        unit.set_gradient_divide_factor(divide)  # type: ignore[operator]


def _named(root: nn.Module, sub: nn.Module, names: set[str]) -> set[nn.Parameter] | None:
    """The parameters of ``sub`` whose names in ``root`` are ``names``; None for none."""
    ids = {id(q) for q in sub.parameters()}
    found = {q for n, q in root.named_parameters() if n in names and id(q) in ids}
    return found or None


def is_sharded(t: Tensor | None) -> bool:
    # Without ZeRO 2 / 3 nothing imported DTensor, and importing it costs about a second.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def data_local(t: Tensor) -> Tensor:
    """This rank's own elements: a DTensor's data shard, a plain tensor itself."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def tp_local(t: Tensor) -> Tensor:
    """The tensor-parallel shard: a DTensor all-gathered over the data ranks (collective)."""
    return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined]


def _chunk(full: Tensor, dtensor: Any) -> Tensor:
    """This rank's dim-0 chunk of ``full``, as FSDP2 cuts it (``torch.chunk``; empty past the end)."""
    # The mesh dim FSDP2 shards over: the only one of a 1-D mesh, the last (shard) one with HSDP.
    dim = dtensor.device_mesh.ndim - 1
    n, i = dtensor.device_mesh.size(dim), dtensor.device_mesh.get_local_rank(dim)
    chunks = full.chunk(n, dim=0)
    return chunks[i] if i < len(chunks) else full[0:0]


@torch.no_grad()
def store_tp_local(target: Tensor, full: Tensor) -> None:
    """Copy the tensor-parallel shard ``full`` into ``target`` (its data chunk if a DTensor)."""
    if is_sharded(target):
        data_local(target).copy_(_chunk(full, target))
    else:
        target.copy_(full)


def like_sharded(param: Any, full: Tensor) -> Tensor:
    """``full`` (shaped like the tensor-parallel shard) as a DTensor sharded like ``param``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        _chunk(full, param).clone(), param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )
