"""Megatron-style tensor-parallel collectives as autograd Functions over plain ``torch.distributed``.

``torch.distributed.nn.functional.all_reduce`` cannot be used for these: its backward all-reduces
again, so a row-parallel layer gets weight gradients tensor-size times too large (see
tests/runtime/test_collectives.py), and its all_gather fails on sub-groups that lack global rank 0.
Every operator treats ``group=None`` (an axis of size 1) as the identity, so generated code can
call them unconditionally.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["all_reduce_sum", "copy_to", "gather_from", "reduce_from", "split_to"]


def all_reduce_sum(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Out-of-place sum over ``group`` without autograd."""
    if group is None:
        return x
    out = x.contiguous().clone()
    # [any shape] -> same shape, summed over the group.
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _all_gather_cat(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    parts = [
        torch.empty_like(x, memory_format=torch.contiguous_format)
        for _ in range(dist.get_world_size(group))
    ]
    # [.., n_local, ..] per rank -> [.., n_local * world, ..] along dim, in group-rank order.
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _own_chunk(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {n} ranks")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _own_chunk(grad, ctx.group, ctx.dim), None, None


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _all_gather_cat(grad, ctx.group, ctx.dim), None, None


def copy_to(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """f: identity forward; all-reduce (sum) of the gradient over ``group`` backward.

    Placed where a replicated activation enters column-parallel layers, whose per-rank input
    gradients are partial sums.
    """
    return x if group is None else _CopyTo.apply(x, group)


def reduce_from(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """g: all-reduce (sum) forward; identity backward.  Partial(group) -> Replicate."""
    return x if group is None else _ReduceFrom.apply(x, group)


def gather_from(x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
    """All-gather and concatenate along ``dim`` forward; keep own chunk backward.

    Shard(dim) -> Replicate; chunks are ordered by group rank.
    """
    return x if group is None else _GatherFrom.apply(x, group, dim)


def split_to(x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
    """Keep own chunk along ``dim`` forward; all-gather backward.  Replicate -> Shard(dim)."""
    return x if group is None else _SplitTo.apply(x, group, dim)
